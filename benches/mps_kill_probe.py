"""Does an MPS client that exits while its kernel runs fault the other clients?

No moelink here: one victim and N survivors, each a separate process with its own
CUDA context (under the MPS daemon whose pipe CUDA_MPS_PIPE_DIRECTORY names). The
survivors start a long ``torch.cuda._sleep`` kernel; the victim starts one too and
leaves with ``os._exit(0)`` while it runs; each survivor then synchronizes and
prints OK or the CUDA error it got. Usage: python3 benches/mps_kill_probe.py
[--trials T] [--survivors N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def child(role: str, go: str) -> None:
    import torch

    torch.cuda.init()
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    open(go + "." + role + str(os.getpid()), "w").close()
    while not os.path.exists(go):  # every process has a context: start together
        time.sleep(0.001)
    cycles = int(2e9)  # ~1 s at 1.98 GHz
    torch.cuda._sleep(cycles)
    if role == "victim":
        time.sleep(0.2)
        os._exit(0)
    try:
        torch.cuda._sleep(cycles)
        y = (x * 2).sum().item()
        torch.cuda.synchronize()
        print(f"survivor {os.getpid()}: OK ({y:.0f})", flush=True)
    except Exception as e:  # noqa: BLE001 - the point is to report it
        print(f"survivor {os.getpid()}: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
        os._exit(1)
    os._exit(0)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--survivors", type=int, default=2)
    a = ap.parse_args()
    bad = 0
    for t in range(a.trials):
        go = f"/tmp/mps_kill_probe_{os.getpid()}_{t}"
        roles = ["victim"] + ["survivor"] * a.survivors
        procs = [subprocess.Popen([sys.executable, __file__, "--child", r, go]) for r in roles]
        deadline = time.time() + 60
        ready = os.path.basename(go) + "."
        while sum(f.startswith(ready) for f in os.listdir("/tmp")) < len(roles):
            if time.time() > deadline:
                print("start-up timed out", flush=True)
                break
            time.sleep(0.01)
        open(go, "w").close()
        rcs = [p.wait(timeout=60) for p in procs]
        bad += sum(1 for rc in rcs[1:] if rc != 0)
        print(f"trial {t}: victim rc {rcs[0]}, survivors rc {rcs[1:]}", flush=True)
    print(f"mps_kill_probe: {bad} survivor(s) failed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
