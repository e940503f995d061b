"""The timeline of one internode dispatch from a torch profiler trace
(``intranode_bench.py --trace``): ``python3 extract.py trace-rankN.json LABEL``.
GPU activity from 0.5 ms before internode_notify to 20 s after, host CUDA calls of
its first 2 ms; the proxy's copies after the time bound are cut to 6."""

import json
import sys

path, label = sys.argv[1], sys.argv[2]
ev = json.load(open(path))["traceEvents"]
t0 = [e for e in ev if e.get("name") == "internode_notify"][0]["ts"]
print(f"# {label}: {path.split('/')[-1]}, times in us from internode_notify's start")
print("# G = GPU activity (stream), H = host call of the main thread")
rows = []
for e in ev:
    ts = e.get("ts", 0) - t0
    if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and -500 <= ts <= 20e6:
        a = e["args"]
        name = e["name"][:44]
        rows.append(
            (
                ts,
                f"G {ts:14.1f} {e['dur']:12.1f}  {name:44s} stream={a.get('stream')} "
                f"bytes={a.get('bytes')}",
            )  # fmt: skip
        )
    if e.get("cat") in ("cuda_runtime", "cuda_driver") and -50 <= ts <= 2000:
        rows.append((ts, f"H {ts:14.1f} {e.get('dur', 0):12.1f}  {e['name'][:44]}"))
rows.sort()
out = []
copies_after = 0
for ts, r in rows:
    if "Memcpy PtoP" in r and ts > 1e6:
        copies_after += 1
        if copies_after > 6:
            continue
    out.append(r)
print("\n".join(out))
print(
    f"# ... {max(0, copies_after - 6)} more proxy copies (stream of the PtoP rows) "
    "after the time bound"
)
