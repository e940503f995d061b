"""Prepares DeepEP V1's own test programs to run on a 4-GPU host, through
``import deep_ep`` (moelink's alias package, or a real DeepEP for comparison).

DeepEP's tests are not part of this repository: this module copies the four files
(``utils.py``, ``test_intranode.py``, ``test_low_latency.py``, ``test_internode.py``,
from a DeepEP V1 checkout's ``tests/`` folder, commit 567632d) from SRC to DST and
applies exactly these edits, nothing else:

* ``internode-main-8-local-ranks``: ``test_internode.test_main`` asserts 8 ranks per
  node; the assert keeps its ``num_experts % num_ranks == 0`` part only.
* ``internode-loop-8-local-ranks``: ``test_internode.test_loop`` asserts 8 ranks per
  node and more than 8 ranks; it becomes ``num_ranks > num_local_ranks`` (still more
  than one node), so that two emulated nodes of 2 ranks run on 4 GPUs.
* ``init-dist-device-id`` and ``init-dist-set-device``: ``utils.init_dist`` picks GPU
  ``local_rank``; it picks the global rank ``node_rank * num_local_ranks +
  local_rank`` modulo the visible GPU count instead, so that the two emulated nodes
  of one host use GPUs 0,1 and 2,3 rather than both 0,1.
* ``shrink-clean-rank``: ``test_low_latency.simulate_failure_and_skip`` fails rank 1
  at its first dispatch, rank 3 at its first combine and rank 5 at its first
  ``clean_low_latency_buffer``; below 6 ranks rank 5 does not exist, so the mask
  check after the clean expects a rank no library can report. There the clean's
  failing rank becomes 2 (still one failure per API: ranks 1, 3 and 2 at 4 ranks);
  from 6 ranks on it stays 5.

Each edit is a targeted regular expression and must apply at least once, else the
run fails naming the edit (a changed DeepEP fails loudly rather than running an
unpatched test). The unified diff of what changed is written to DST/PATCH.diff.

Usage: ``python benches/deepep_patch.py SRC DST`` (SRC: DeepEP's ``tests/`` folder,
or the checkout holding it). ``benches/deepep_tests.sh`` runs the patched tests.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: The files copied from DeepEP's tests folder (test_internode imports the others).
FILES = ("utils.py", "test_intranode.py", "test_low_latency.py", "test_internode.py")

#: The global rank, modulo the visible GPUs: the GPU ``utils.init_dist`` picks.
GPU_EXPR = "(node_rank * num_local_ranks + local_rank) % torch.cuda.device_count()"

_S = r"[ \t]*"  # optional spaces within a line
_S1 = r"[ \t]+"


@dataclass(frozen=True)
class Edit:
    """One allowed edit: ``pattern`` (multi-line regex) replaced by ``repl`` in
    ``file``, within the top-level function ``scope`` when given; ``requires`` are
    regexes the scope must match for the replacement to be valid code there."""

    name: str
    file: str
    pattern: str
    repl: str
    what: str
    scope: str | None = None
    requires: tuple[str, ...] = field(default_factory=tuple)


def _init_dist_gpu_edit(name: str, pattern: str, repl: str, what: str) -> Edit:
    """An edit of ``utils.init_dist`` that puts ``GPU_EXPR`` where it names GPU
    ``local_rank``: valid there only while init_dist defines ``node_rank`` and
    reads ``num_local_ranks``, which ``GPU_EXPR`` uses."""
    return Edit(
        name=name,
        file="utils.py",
        pattern=pattern,
        repl=repl,
        what=what,
        scope="init_dist",
        requires=(r"^\s*node_rank\s*=", r"\bnum_local_ranks\b"),
    )


EDITS = (
    Edit(
        name="internode-main-8-local-ranks",
        file="test_internode.py",
        pattern=(
            rf"^(?P<head>{_S}assert{_S1}num_experts{_S}%{_S}num_ranks{_S}=={_S}0)"
            rf"{_S1}and{_S1}num_local_ranks{_S}=={_S}8{_S}$"
        ),
        repl=r"\g<head>",
        what="`assert num_experts % num_ranks == 0 and num_local_ranks == 8` in test_main",
        scope="test_main",
    ),
    Edit(
        name="internode-loop-8-local-ranks",
        file="test_internode.py",
        pattern=(
            rf"^(?P<indent>{_S})assert{_S1}num_local_ranks{_S}=={_S}8"
            rf"{_S1}and{_S1}num_ranks{_S}>{_S}8{_S}$"
        ),
        repl=r"\g<indent>assert num_ranks > num_local_ranks",
        what="`assert num_local_ranks == 8 and num_ranks > 8` in test_loop",
        scope="test_loop",
    ),
    _init_dist_gpu_edit(
        "init-dist-device-id",
        r"torch\.device\(f(?P<q>['\"])cuda:\{local_rank\}(?P=q)\)",
        rf"torch.device(f\g<q>cuda:{{{GPU_EXPR}}}\g<q>)",
        "`device_id=torch.device(f'cuda:{local_rank}')` in init_dist",
    ),
    _init_dist_gpu_edit(
        "init-dist-set-device",
        rf"torch\.cuda\.set_device\({_S}local_rank{_S}\)",
        f"torch.cuda.set_device({GPU_EXPR})",
        "`torch.cuda.set_device(local_rank)` in init_dist",
    ),
    Edit(
        name="shrink-clean-rank",
        file="test_low_latency.py",
        pattern=rf"(?P<key>(?P<q>['\"])clean(?P=q){_S}:{_S})5\b",
        repl=r"\g<key>5 if torch.distributed.get_world_size() > 5 else 2",
        what="`'clean': 5` in simulate_failure_and_skip",
        scope="simulate_failure_and_skip",
    ),
)


class PatchError(RuntimeError):
    """An edit did not apply (``edit`` names it), or a file is missing."""

    def __init__(self, edit: str, message: str):
        super().__init__(f"edit '{edit}' did not apply: {message}")
        self.edit = edit


def _scope_span(text: str, func: str) -> tuple[int, int] | None:
    """The span of top-level function ``func`` in ``text``: from its ``def`` line to
    the next line that starts with code at column 0 (a column-0 comment just
    before that stays inside; no edit targets comments)."""
    m = re.search(rf"^def{_S1}{re.escape(func)}{_S}\(", text, re.M)
    if m is None:
        return None
    line_end = text.find("\n", m.start())
    if line_end < 0:
        return m.start(), len(text)
    nxt = re.compile(r"^[^\s#]", re.M).search(text, line_end + 1)
    return m.start(), (nxt.start() if nxt else len(text))


def apply_edit(text: str, edit: Edit) -> tuple[str, int]:
    """``text`` with ``edit`` applied and the number of substitutions; raises
    :class:`PatchError` when it applies nowhere or its scope lacks what it needs."""
    start, stop = 0, len(text)
    if edit.scope is not None:
        span = _scope_span(text, edit.scope)
        if span is None:
            raise PatchError(edit.name, f"{edit.file} has no function {edit.scope}()")
        start, stop = span
    body = text[start:stop]
    for req in edit.requires:
        if re.search(req, body, re.M) is None:
            raise PatchError(
                edit.name, f"{edit.file}: {edit.scope or 'file'} lacks /{req}/ the edit relies on"
            )
    new_body, n = re.subn(edit.pattern, edit.repl, body, flags=re.M)
    if n == 0:
        raise PatchError(edit.name, f"{edit.file}: no {edit.what}")
    return text[:start] + new_body + text[stop:], n


def patch_files(texts: dict[str, str]) -> tuple[dict[str, str], list[tuple[Edit, int]]]:
    """The patched texts of ``texts`` (file name -> text) and every edit with its
    substitution count; raises :class:`PatchError` at the first edit that fails."""
    out = dict(texts)
    applied = []
    for edit in EDITS:
        if edit.file not in out:
            raise PatchError(edit.name, f"{edit.file} is missing")
        out[edit.file], n = apply_edit(out[edit.file], edit)
        applied.append((edit, n))
    return out, applied


def unified_diff(before: dict[str, str], after: dict[str, str]) -> str:
    """The unified diff from ``before`` to ``after``, file by file in FILES order."""
    parts = []
    for name in sorted(before, key=lambda f: (FILES.index(f) if f in FILES else len(FILES), f)):
        parts.extend(
            difflib.unified_diff(
                before[name].splitlines(keepends=True),
                after[name].splitlines(keepends=True),
                fromfile=f"a/tests/{name}",
                tofile=f"b/tests/{name}",
            )
        )
    return "".join(parts)


def find_tests_dir(src: Path) -> Path:
    """``src`` itself when it holds the files, else its ``tests/`` folder."""
    if not (src / FILES[0]).is_file() and (src / "tests" / FILES[0]).is_file():
        return src / "tests"
    return src


def patch_dir(src: Path, dst: Path) -> list[tuple[Edit, int]]:
    """Copies FILES from ``src`` to ``dst``, patches them there and writes
    ``dst/PATCH.diff``; returns the applied edits with their counts. Nothing is
    written to ``dst`` when an edit fails."""
    src = find_tests_dir(Path(src))
    missing = [f for f in FILES if not (src / f).is_file()]
    if missing:
        raise PatchError("copy", f"{src} lacks {', '.join(missing)} (DeepEP V1's tests/ folder?)")
    before = {f: (src / f).read_text() for f in FILES}
    after, applied = patch_files(before)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        (dst / f).write_text(after[f])
        shutil.copymode(src / f, dst / f)
    (dst / "PATCH.diff").write_text(unified_diff(before, after))
    return applied


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="DeepEP V1's tests/ folder (or its checkout)")
    ap.add_argument("dst", type=Path, help="where the patched copies and PATCH.diff go")
    args = ap.parse_args(argv)
    try:
        applied = patch_dir(args.src, args.dst)
    except PatchError as e:
        print(f"deepep_patch: {e}", file=sys.stderr)
        return 1
    for edit, n in applied:
        print(f"deepep_patch: applied {edit.name} ({edit.file}, {n}x)")
    print(f"deepep_patch: diff in {args.dst / 'PATCH.diff'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
