#!/usr/bin/env python3
"""Records a GPU run under benches/results/<date>_<name>/: its logs plus run.json
(date, machine, commit, command, per-step exit codes), from the folder the device
tool brought back.

    python3 scripts/record_gpu_run.py /work/.device/N NAME "the command that ran"
"""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
from pathlib import Path


def main() -> int:
    src, name, command = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    machine = (src / "machine.txt").read_text().splitlines()
    info = dict(line.split("=", 1) for line in machine if "=" in line and " " not in line)
    gpus = [line for line in machine if "NVIDIA" in line and "," in line]
    summary_file = src / "summary.json"
    if summary_file.exists():
        summary = json.loads(summary_file.read_text())
    else:  # the run hit its time limit before writing the summary
        summary = {"results": {"incomplete": "no summary.json: the run hit its time limit"}}
    date = info.get("date", "unknown")[:10]
    dst = Path("benches/results") / f"{date}_{name}"
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name == "steps.tgz":
            with tarfile.open(f) as tar:
                tar.extractall(dst, filter="data")  # -> dst/steps/<step>.log
        elif f.is_file():
            shutil.copy(f, dst / f.name)
        elif f.is_dir():
            shutil.copytree(f, dst / f.name, dirs_exist_ok=True)
    run = {
        "date": info.get("date"),
        "machine": {"gpus": gpus, "count": len(gpus)},
        "commit": info.get("commit"),
        "dirty": info.get("dirty"),
        "command": command,
        "results": summary["results"],
    }
    (dst / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    print(f"recorded {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
