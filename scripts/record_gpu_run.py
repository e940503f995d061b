#!/usr/bin/env python3
"""Records a GPU run as benches/results/<date>_<machine>_<topic>/, from the output
folder of `scripts/gpu_run.sh`, `benches/speed_run.sh` or any benchmark (its
machine.txt names the GPUs and the build):

    python3 scripts/record_gpu_run.py OUT_DIR TOPIC "the command that ran"

The record holds only:
- NOTE.md: date, machine, commit, command, every step's exit code and seconds, and
  a section "What it shows" for the reader's headline figures (to be written);
- run.json: the same facts, machine-readable;
- the benchmark JSON and PNG files found anywhere in OUT_DIR, at the top of the
  record, named after their path (``intranode/peer_moelink.json`` ->
  ``intranode-peer_moelink.json``);
- logs.tar.gz: every other file (logs, tables, machine.txt, summary.json), nested
  archives (steps.tgz) unpacked first, under its path in OUT_DIR.
Scripts and patches (*.sh, *.py, *.patch) are left out: they belong in git.

TOPIC says what was measured (``speed-intranode-ll``, ``one-gpu-suites``), not
when or by whom (no session, call or issue numbers).
"""

from __future__ import annotations

import datetime
import gzip
import io
import json
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

RESULTS = Path("benches/results")
#: Files kept at the top of a record; everything else goes into logs.tar.gz.
KEPT_SUFFIXES = (".json", ".png")
#: Raw outputs that are JSON but belong with the logs.
LOG_JSON = {"summary.json", "run.json"}
#: Not recorded at all: tools live in the repository, not in records.
SCRIPT_SUFFIXES = (".sh", ".py", ".patch")
#: Nested archives, unpacked before the logs are packed once.
NESTED = (".tgz", ".tar.gz")
#: Words that make a topic a diary entry rather than a subject.
DIARY = re.compile(r"(?i)session|\bcalls?\d*\b|issues?-?\d")


def parse_machine(text: str) -> dict:
    """``key=value`` lines (BUILD_INFO, ``date=``) and the GPU lines
    (``index, name, memory, driver`` from nvidia-smi) of machine.txt."""
    lines = text.splitlines()
    info = dict(line.split("=", 1) for line in lines if "=" in line and " " not in line)
    gpus = [line.strip() for line in lines if "NVIDIA" in line and "," in line]
    return {"info": info, "gpus": gpus}


def machine_slug(gpus: list[str]) -> str:
    """``h200x4`` for four H200, ``h100`` for one H100 (every rank on it),
    ``h100-h200`` for a mix; ``gpu`` when machine.txt names none."""
    models: dict[str, int] = {}
    for line in gpus:
        fields = [f.strip() for f in line.split(",")]
        name = fields[1] if len(fields) > 1 else line
        m = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Za-z]?)\b", name.replace("NVIDIA", ""))
        model = m.group(1).lower() if m else "gpu"
        models[model] = models.get(model, 0) + 1
    if not models:
        return "gpu"
    return "-".join(f"{m}x{n}" if n > 1 else m for m, n in sorted(models.items()))


def run_date(info: dict) -> str:
    """The run's date: machine.txt's ``date=``, else the build's ``built=``, else today (UTC)."""
    for key in ("date", "built"):
        if info.get(key):
            return info[key][:10]
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def flat_name(rel: Path) -> str:
    return "-".join(rel.parts)


def unpack_nested(root: Path) -> None:
    """Unpack every nested archive in place (steps.tgz -> steps/...), then drop it."""
    for archive in sorted(p for p in root.rglob("*") if p.name.endswith(NESTED)):
        with tarfile.open(archive) as tar:
            tar.extractall(archive.parent, filter="data")
        archive.unlink()


def pack(root: Path, dst: Path) -> int:
    """root's files into dst (gzip, sorted, no owners or times: the same logs give
    the same bytes); the number of files, 0 (and no archive) when there are none."""
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not files:
        return 0
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for p in files:
            ti = tar.gettarinfo(str(p), arcname=p.relative_to(root).as_posix())
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = ""
            ti.mtime = 0
            ti.mode = 0o644
            with p.open("rb") as f:
                tar.addfile(ti, f)
    with dst.open("wb") as f, gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as g:
        g.write(raw.getvalue())
    return len(files)


def note_text(topic: str, run: dict, kept: list[str], n_logs: int) -> str:
    gpus = run["machine"]["gpus"]
    machine = "; ".join(gpus) if gpus else "not named in machine.txt"
    rows = [
        f"| {step} | {r.get('rc', '-')} | {r.get('seconds', '-')} |"
        if isinstance(r, dict)
        else f"| {step} | {r} | - |"
        for step, r in run["results"].items()
    ]
    files = ", ".join(f"`{k}`" for k in kept) or "none"
    logs = f"`logs.tar.gz` ({n_logs} files: logs, machine.txt, summaries)" if n_logs else "no logs"
    return "\n".join(
        [
            f"# {topic} ({run['date'] or 'date unknown'})",
            "",
            f"- **Date.** {run['date'] or 'unknown'}",
            f"- **Machine.** {len(gpus)} GPU(s): {machine}",
            f"- **Commit.** {run['commit'] or 'unknown'} (dirty: {run['dirty'] or 'unknown'})",
            f"- **Command.** `{run['command']}`",
            f"- **Files.** `run.json`; {files}; {logs}.",
            "",
            "## Steps",
            "",
            "| step | exit code | seconds |",
            "|---|---|---|",
            *rows,
            "",
            "## What it shows",
            "",
            "To write: the headline figures and what they mean. Then add the record to",
            "benches/results/README.md, and move the record it supersedes to the",
            "history table there (with `git log -1 --format=%h -- <folder>`).",
            "",
        ]
    )


def record(src: Path, topic: str, command: str, results: Path = RESULTS) -> Path:
    if DIARY.search(topic):
        raise SystemExit(
            f"record_gpu_run: topic {topic!r} names a session, call or issue: "
            "name what was measured (e.g. speed-intranode-ll, one-gpu-suites)"
        )
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", topic):
        raise SystemExit(f"record_gpu_run: topic {topic!r}: lower-case words joined by '-'")
    machine_file = src / "machine.txt"
    parsed = parse_machine(machine_file.read_text() if machine_file.exists() else "")
    info, gpus = parsed["info"], parsed["gpus"]
    summary_file = src / "summary.json"
    if summary_file.exists():
        step_results = json.loads(summary_file.read_text())["results"]
    else:  # a benchmark run, or a run cut by its time limit before its summary
        step_results = {"incomplete": "no summary.json (a direct command, or cut by its limit)"}
    date = run_date(info)
    dst = results / f"{date}_{machine_slug(gpus)}_{topic}"
    if dst.exists():
        raise SystemExit(f"record_gpu_run: {dst} exists: choose another topic or remove it")
    run = {
        "date": info.get("date") or date,
        "machine": {"gpus": gpus, "count": len(gpus)},
        "commit": info.get("commit"),
        "dirty": info.get("dirty"),
        "command": command,
        "results": step_results,
    }
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "out"
        shutil.copytree(src, stage)
        unpack_nested(stage)
        dst.mkdir(parents=True)
        kept = []
        for p in sorted(stage.rglob("*")):
            if not p.is_file():
                continue
            if p.suffix in SCRIPT_SUFFIXES:
                print(f"left out {p.relative_to(stage)} (scripts belong in git)")
                p.unlink()
            elif p.suffix in KEPT_SUFFIXES and p.name not in LOG_JSON:
                name = flat_name(p.relative_to(stage))
                shutil.move(str(p), dst / name)
                kept.append(name)
        n_logs = pack(stage, dst / "logs.tar.gz")
    (dst / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    (dst / "NOTE.md").write_text(note_text(topic, run, kept, n_logs))
    print(f"recorded {dst}: NOTE.md, run.json, {len(kept)} JSON/PNG, {n_logs} files in logs.tar.gz")
    return dst


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    record(Path(argv[1]), argv[2], argv[3])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
