"""docs/architecture.md's layer table against the workspace's real dependencies
(`cargo metadata`): a crate that gains a dependency the table forbids fails here."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def layer_table() -> dict[str, set[str]]:
    """{crate: crates it may depend on} from the table under '### Layers'."""
    text = DOC.read_text()
    section = text.split("### Layers", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| ([a-z][a-z0-9_-]*) \| ([^|]*) \|$", section, flags=re.M)
    table = {}
    for crate, allowed in rows[1:]:  # rows[0] is the header
        deps = {d.strip() for d in allowed.split(",")} - {"(none)", ""}
        table[crate] = deps
    return table


def workspace_deps() -> dict[str, set[str]]:
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("cargo is not on PATH (scripts/test.sh and CI have it)")
    out = subprocess.run(
        [cargo, "metadata", "--format-version", "1", "--no-deps", "--offline"],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    meta = json.loads(out.stdout)
    names = {p["name"] for p in meta["packages"]}
    return {
        p["name"]: {d["name"] for d in p["dependencies"] if d["name"] in names}
        for p in meta["packages"]
    }


def test_the_table_parses():
    table = layer_table()
    assert "comm" in table and table["comm"] == {"build-utils"}, table
    assert table["build-utils"] == set(), table


def test_every_crate_keeps_to_its_layer():
    table = layer_table()
    deps = workspace_deps()
    assert set(table) == set(deps), (
        f"the table names {sorted(set(table) - set(deps))} that the workspace lacks and "
        f"misses {sorted(set(deps) - set(table))}"
    )
    bad = {c: sorted(d - table[c]) for c, d in deps.items() if d - table[c]}
    assert not bad, f"dependencies docs/architecture.md does not allow: {bad}"
