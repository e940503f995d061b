"""Writes the table of docs/environment.md from the library's registry of
environment switches (``comm::env::SWITCHES``, read through the installed
package's ``moelink._native.env_switches()``).

    python scripts/env_table.py          # rewrites the table in docs/environment.md
    python scripts/env_table.py --check  # exit 1 where the table differs

tests/test_env_registry.py checks the same equality."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "environment.md"
BEGIN = "<!-- env-table: begin (scripts/env_table.py writes it) -->"
END = "<!-- env-table: end -->"


def render(switches) -> str:
    """The Markdown table of ``(name, kind, default, meaning)`` rows, sorted by name."""
    lines = ["| name | kind | default | meaning |", "| --- | --- | --- | --- |"]
    for name, kind, default, meaning in sorted(switches):
        lines.append(f"| `{name}` | {kind} | {default} | {meaning} |")
    return "\n".join(lines)


def replaced(text: str, table: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare")
    args = parser.parse_args()
    from moelink import _native

    text = DOC.read_text()
    new = replaced(text, render(_native.env_switches()))
    if args.check:
        if new != text:
            print(f"{DOC} differs from the registry; run scripts/env_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
