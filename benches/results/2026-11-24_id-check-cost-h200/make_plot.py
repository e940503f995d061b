"""Parses the `python -m moelink --ranks 2` table of the run in
../2026-11-24_shared-gpu-main-timeslice-trap-h200/steps/extra.log into
id_check.json and id_check.png: per-call medians with the device-side expert-id
check only (the default) and with the host-side check as well (MOELINK_CHECK_IDS=1,
the previous default: a device sync per call)."""

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
log = (here.parent / "2026-11-24_shared-gpu-main-timeslice-trap-h200/steps/extra.log").read_text()
section = log.split("##### main --ranks 2", 1)[1].split("#####", 1)[0]
rows = {}
for line in section.splitlines():
    m = re.match(
        r"^(layout, host id check|layout|dispatch bf16 uncached|uncached\+host id chk)\s+"
        r"(-|\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)",
        line,
    )
    if m:
        op, sms, med, lo, hi = m.groups()
        rows.setdefault(op, []).append(
            {
                "num_sms": None if sms == "-" else int(sms),
                "median_us": float(med),
                "min_us": float(lo),
                "max_us": float(hi),
            }
        )
out = {
    "what": "per-call time, 2 ranks sharing one H200 under MPS, 4096 tokens/rank, hidden 7168, "
    "top-8 of 256 experts, 20 iterations after 5 warm-up (CUDA events, L2 flushed)",
    "device_check": {"layout": rows["layout"], "dispatch_uncached": rows["dispatch bf16 uncached"]},
    "host_check": {
        "layout": rows["layout, host id check"],
        "dispatch_uncached": rows["uncached+host id chk"],
    },
}
(here / "id_check.json").write_text(json.dumps(out, indent=2) + "\n")
sms = [r["num_sms"] for r in rows["dispatch bf16 uncached"]]
dev = [r["median_us"] for r in rows["dispatch bf16 uncached"]]
host = [r["median_us"] for r in rows["uncached+host id chk"]]
x = range(len(sms))
plt.figure(figsize=(6, 3.5))
plt.bar([i - 0.2 for i in x], dev, 0.4, label="device-side id check (default)")
plt.bar([i + 0.2 for i in x], host, 0.4, label="host-side check (MOELINK_CHECK_IDS=1)")
plt.xticks(list(x), [f"{s} SMs" for s in sms])
plt.ylabel("median us per uncached dispatch")
plt.title("Expert-id check cost, 2 ranks on one H200")
plt.legend(fontsize=8)
plt.tight_layout()
plt.savefig(here / "id_check.png", dpi=120)
print(
    json.dumps(out["device_check"]["dispatch_uncached"]),
    json.dumps(out["host_check"]["dispatch_uncached"]),
)
