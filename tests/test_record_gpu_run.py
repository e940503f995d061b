"""scripts/record_gpu_run.py and the records under benches/results, on the CPU:
a record holds NOTE.md, its JSON, its PNG plots and one logs.tar.gz, nothing else."""

from __future__ import annotations

import io
import json
import re
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import record_gpu_run  # noqa: E402

RESULTS = ROOT / "benches" / "results"
#: <date>_<machine>_<topic>: machine like h200x4, h100, h100x2, h100-h200.
MACHINE = r"[a-z]\d{2,3}[a-z]?(x\d+)?"
RECORD_NAME = re.compile(rf"\d{{4}}-\d{{2}}-\d{{2}}_{MACHINE}(-{MACHINE})*_[a-z0-9.-]+")

MACHINE_TXT = """commit=0123456789abcdef0123456789abcdef01234567
dirty=no
built=2026-11-27T09:00:00Z
date=2026-11-27T10:11:12Z
0, NVIDIA H200, 143771 MiB, 580.159.04
1, NVIDIA H200, 143771 MiB, 580.159.04
2, NVIDIA H200, 143771 MiB, 580.159.04
3, NVIDIA H200, 143771 MiB, 580.159.04
        GPU0    GPU1
torch 2.11.0+cu130 cuda 13.0 gpus 4
"""


def _steps_tgz(path: Path, logs: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in logs.items():
            data = text.encode()
            info = tarfile.TarInfo(f"steps/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _gpu_run_out(tmp_path: Path) -> Path:
    """An output folder as scripts/gpu_run.sh plus a benchmark leave it."""
    out = tmp_path / "out"
    (out / "intranode" / "direct").mkdir(parents=True)
    (out / "machine.txt").write_text(MACHINE_TXT)
    (out / "summary.json").write_text(
        json.dumps(
            {"results": {"intranode-4": {"rc": 0, "seconds": 61}, "extra": {"rc": 1, "seconds": 3}}}
        )
    )
    _steps_tgz(out / "steps.tgz", {"intranode-4.log": "PASS layout\n", "extra.log": "oops\n"})
    (out / "intranode" / "peer_moelink.json").write_text('{"impl": "moelink"}')
    (out / "intranode" / "direct" / "peer_moelink.json").write_text('{"impl": "moelink"}')
    (out / "intranode" / "peer_table.png").write_bytes(b"\x89PNG fake")
    (out / "intranode" / "table.txt").write_text("table\n")
    (out / "probe.sh").write_text("echo one-off\n")
    return out


def test_record_holds_note_json_png_and_one_archive(tmp_path):
    out = _gpu_run_out(tmp_path)
    command = "bash benches/speed_run.sh intranode OUT"
    dst = record_gpu_run.record(out, "speed-intranode", command, tmp_path / "results")
    assert dst.name == "2026-11-27_h200x4_speed-intranode"
    assert sorted(p.name for p in dst.iterdir()) == [
        "NOTE.md",
        "intranode-direct-peer_moelink.json",
        "intranode-peer_moelink.json",
        "intranode-peer_table.png",
        "logs.tar.gz",
        "run.json",
    ]
    with tarfile.open(dst / "logs.tar.gz") as tar:
        names = sorted(tar.getnames())
        assert all(m.mtime == 0 and m.uid == 0 for m in tar.getmembers())
    # steps.tgz unpacked (one level of compression), the script left out
    assert names == [
        "intranode/table.txt",
        "machine.txt",
        "steps/extra.log",
        "steps/intranode-4.log",
        "summary.json",
    ]
    run = json.loads((dst / "run.json").read_text())
    assert run["commit"].startswith("0123456")
    assert run["machine"]["count"] == 4
    assert run["results"]["extra"]["rc"] == 1
    note = (dst / "NOTE.md").read_text()
    for fact in ("**Date.** 2026-11-27T10:11:12Z", "4 GPU(s)", "0123456789abcdef", command):
        assert fact in note
    assert "| extra | 1 | 3 |" in note


def test_record_without_summary_or_date(tmp_path):
    """benches/speed_run.sh leaves no summary.json; an older machine.txt no date=."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "machine.txt").write_text(
        "0, NVIDIA H100 80GB HBM3, 81559 MiB, 580.159.04\ncommit=abc\nbuilt=2026-11-25T08:00:00Z\n"
    )
    (out / "comm_bench.log").write_text("targets met: 2 of 5\n")
    dst = record_gpu_run.record(out, "comm", "cmd", tmp_path / "results")
    assert dst.name == "2026-11-25_h100_comm"
    assert "incomplete" in json.loads((dst / "run.json").read_text())["results"]


def test_the_same_record_twice_is_refused(tmp_path):
    out = _gpu_run_out(tmp_path)
    record_gpu_run.record(out, "suites", "cmd", tmp_path / "results")
    with pytest.raises(SystemExit, match="exists"):
        record_gpu_run.record(out, "suites", "cmd", tmp_path / "results")


@pytest.mark.parametrize(
    "topic", ["ninth-session", "call3-probe", "issue16-epbuffer", "issues19-20", "Speed"]
)
def test_topics_name_what_was_measured(tmp_path, topic):
    with pytest.raises(SystemExit):
        record_gpu_run.record(_gpu_run_out(tmp_path), topic, "cmd", tmp_path / "results")


@pytest.mark.parametrize(
    "gpus, slug",
    [
        (["0, NVIDIA H200, 143771 MiB, 580"] * 4, "h200x4"),
        (["0, NVIDIA H100 80GB HBM3, 81559 MiB, 580"], "h100"),
        (["0, NVIDIA H100 80GB HBM3, 1, 2", "1, NVIDIA H200, 1, 2"], "h100-h200"),
        ([], "gpu"),
    ],
)
def test_machine_slug(gpus, slug):
    assert record_gpu_run.machine_slug(gpus) == slug


# The records in the repository keep the same layout.

RECORDS = sorted(p for p in RESULTS.iterdir() if p.is_dir()) if RESULTS.is_dir() else []


def test_results_hold_only_records_and_the_index():
    assert RESULTS.is_dir()
    assert [p.name for p in RESULTS.iterdir() if p.is_file()] == ["README.md"]
    assert RECORDS


@pytest.mark.parametrize("rec", RECORDS, ids=lambda p: p.name)
def test_record_layout(rec):
    assert RECORD_NAME.fullmatch(rec.name), rec.name
    files = {p.name for p in rec.iterdir()}
    assert "NOTE.md" in files
    assert all(p.is_file() for p in rec.iterdir()), "no sub-folders: logs go into logs.tar.gz"
    allowed = ("NOTE.md", "logs.tar.gz")
    extra = {f for f in files if f not in allowed and not f.endswith((".json", ".png"))}
    assert not extra, extra
    note = (rec / "NOTE.md").read_text()
    for fact in ("**Date.**", "**Machine", "**Commit.**", "**Command"):
        assert fact in note, f"{rec.name}/NOTE.md lacks {fact}"
    assert not re.search(r"(?i)\bsessions?\b|\bcarried\b|device (time|calls?|tool)", note)


def test_index_lists_every_record():
    index = (RESULTS / "README.md").read_text()
    for rec in RECORDS:
        assert f"({rec.name}/NOTE.md)" in index, rec.name
