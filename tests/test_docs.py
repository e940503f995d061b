"""README.md and docs/*.md against the repository: every path they cite exists in
it, none points outside it (``../``), and they speak of the project and its users
only (no words of one team's tooling). Runs on the CPU, without the package."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cuda_device_count

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Words a user-facing page never uses (whole words, any case).
FORBIDDEN = re.compile(r"(?i)\b(sessions?|carried|device time|remote GPU tool)\b|/work\b")

#: Markdown links ``[text](target)``.
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
#: A path that climbs out of the folder it is read from.
UPWARD = re.compile(r"(?<![\w.])\.\./[\w.+/-]*")


def tracked_files() -> set[str]:
    """Every file git tracks or would add (untracked, not ignored), relative to
    the root; the file system's walk where git is not available."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        files = {line for line in out.stdout.splitlines() if line}
        if files:
            return files
    except (OSError, subprocess.SubprocessError):
        pass
    return {str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()}


FILES = tracked_files()
FOLDERS = {str(Path(f).parents[i]) for f in FILES for i in range(len(Path(f).parents) - 1)}
TOP_LEVEL = {f.split("/", 1)[0] for f in FILES}


def exists(rel: str) -> bool:
    rel = rel.rstrip("/")
    return rel in FILES or rel in FOLDERS


def repo_path_pattern() -> re.Pattern:
    """A token that starts with a top-level entry of the repository and goes on
    with "/" and file-name characters: ``docs/one-gpu.md``, ``scripts/gpu_run.sh``,
    ``benches/results/``. It stops at a placeholder or glob (``<date>``, ``*``)."""
    names = "|".join(sorted((re.escape(t) for t in TOP_LEVEL), key=len, reverse=True))
    return re.compile(rf"(?<![\w./-])(?:\./)?((?:{names})/[\w.+/-]*)")


REPO_PATH = repo_path_pattern()


def cited_paths(doc: Path) -> list[tuple[int, str, bool]]:
    """(line, path, is_link) of what ``doc`` cites as a path: the targets of
    relative Markdown links (relative to ``doc``), every ``../`` path, and every
    token that names a top-level entry of the repository followed by "/"
    (relative to the root). URLs and anchors are not paths."""
    out = []
    for lineno, line in enumerate(doc.read_text().splitlines(), 1):
        links = MD_LINK.findall(line)
        for target in links:
            if re.match(r"^[a-z][a-z0-9+.-]*:|^#", target):
                continue
            out.append((lineno, target.split("#", 1)[0], True))
        text = re.sub(r"[a-z][a-z0-9+.-]*://\S+", "", MD_LINK.sub("]", line))
        out.extend((lineno, up, False) for up in UPWARD.findall(text))
        for path in REPO_PATH.findall(text):
            path = path.rstrip(".-")
            if path.endswith("/") or "/" in path.rstrip("/"):
                out.append((lineno, path, False))
    return out


def test_docs_found():
    assert (ROOT / "README.md").is_file()
    assert len(DOCS) > 5, DOCS


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_paths_exist(doc):
    missing = []
    for lineno, path, is_link in cited_paths(doc):
        if is_link:  # relative to the page
            rel = (doc.parent / path).resolve()
            if not rel.is_relative_to(ROOT):
                missing.append(f"{lineno}: {path} (outside the repository)")
                continue
            if rel == ROOT:
                continue
            path = str(rel.relative_to(ROOT))
        elif path.startswith("../") or "/../" in path:
            missing.append(f"{lineno}: {path} (outside the repository)")
            continue
        if not exists(path) and f"{lineno}: {path}" not in missing:
            missing.append(f"{lineno}: {path}")
    assert not missing, f"{doc.relative_to(ROOT)} cites paths the repository lacks:\n" + "\n".join(
        missing
    )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_team_internal_words(doc):
    hits = [
        f"{lineno}: {line.strip()}"
        for lineno, line in enumerate(doc.read_text().splitlines(), 1)
        if FORBIDDEN.search(line) or "../shared" in line
    ]
    assert not hits, f"{doc.relative_to(ROOT)} speaks of more than the project:\n" + "\n".join(hits)


def test_checker_catches_what_it_should(tmp_path):
    """The rules above on a page written to break each of them."""
    page = tmp_path / "page.md"
    page.write_text(
        "See `docs/no-such-page.md`, [x](../outside.md) and `../shared/design/API.md`;\n"
        "`docs/one-gpu.md`, `benches/results/<date>_NAME/`, `https://example.org/a/b`.\n"
        "One session of carried files.\n"
    )
    cited = {p for _, p, _ in cited_paths(page)}
    assert "docs/no-such-page.md" in cited
    assert "../outside.md" in cited
    assert "../shared/design/API.md" in cited
    assert "docs/one-gpu.md" in cited and exists("docs/one-gpu.md")
    assert not any("<date>" in p or "example.org" in p for p in cited)
    assert not exists("docs/no-such-page.md")
    assert FORBIDDEN.search(page.read_text())


# ----- the README's launch example: examples/moe_layer.py ---------------------------------------

EXAMPLE = ROOT / "examples" / "moe_layer.py"


def run_example(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_readme_launches_the_example():
    readme = (ROOT / "README.md").read_text()
    assert "python -m moelink.launch -n 4 examples/moe_layer.py" in readme
    assert "torchrun --nproc-per-node 4 examples/moe_layer.py" in readme


def test_example_help_needs_no_gpu():
    out = run_example(str(EXAMPLE), "--help")
    assert out.returncode == 0, out.stderr
    assert "moelink.launch" in out.stdout and "--num-experts" in out.stdout


def test_example_says_what_it_needs_without_a_gpu():
    if importlib.util.find_spec("moelink") is None:
        pytest.skip("moelink is not installed here (scripts/test.sh installs it)")
    if cuda_device_count() > 0:
        pytest.skip("a GPU is present: the GPU test below runs the example")
    out = run_example(str(EXAMPLE))
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "needs a CUDA GPU" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.gpu
def test_example_passes_on_two_ranks():
    """Two ranks on whatever GPUs there are (sharing one where there is one)."""
    out = run_example(
        "-m", "moelink.launch", "-n", "2", "--timeout", "240", str(EXAMPLE),
        "--num-tokens", "256", "--hidden", "1024", "--num-experts", "16", "--topk", "4",
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS moe_layer: 2 ranks" in out.stdout, out.stdout + out.stderr
