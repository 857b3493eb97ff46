"""The `vitserve serve` flags reference in the docs, generated from the serve parser, whose flags and help
texts come from `ServeSettings` (service/settings.py): the docs cannot drift from `--help`.

    python3 -m service.flags_doc            # rewrite the marked blocks of docs/api.md and docs/deployment.md
    python3 -m service.flags_doc --check    # exit 1 when a block differs (tests/test_flags_doc.py checks it)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from service.settings import ENV_PREFIX

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "docs" / "api.md", ROOT / "docs" / "deployment.md")
BEGIN = "<!-- flags: generated from service/settings.py by `python3 -m service.flags_doc`; do not edit -->"
END = "<!-- flags: end -->"


def serve_parser() -> argparse.ArgumentParser:
    """The parser `vitserve serve` uses (the same function builds it)."""
    from service.cli import add_serve_parser

    top = argparse.ArgumentParser(prog="vitserve")
    return add_serve_parser(top.add_subparsers())


def flag_rows() -> list[tuple[list[str], str, str]]:
    """(option strings, variable, help text) of every serve flag, in --help order."""
    rows = []
    for action in serve_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        rows.append((list(action.option_strings), ENV_PREFIX + action.dest.upper(), str(action.help)))
    return rows


def render() -> str:
    """The marked block: one table row per flag."""
    lines = [BEGIN, "", "| flag | variable | meaning (default) |", "|---|---|---|"]
    for options, variable, help_text in flag_rows():
        flags = " / ".join(f"`{o}`" for o in options)
        cell = help_text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        lines.append(f"| {flags} | `{variable}` | {cell} |")
    return "\n".join([*lines, "", END])


def replace_block(text: str, block: str) -> str:
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + block + text[end:]


def current_block(text: str) -> str:
    return text[text.index(BEGIN):text.index(END) + len(END)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a block differs")
    args = parser.parse_args(argv)
    block, stale = render(), []
    for path in DOCS:
        text = path.read_text()
        if current_block(text) != block:
            stale.append(path)
            if not args.check:
                path.write_text(replace_block(text, block))
    for path in stale:
        print(f"{path.relative_to(ROOT)}: {'differs from --help' if args.check else 'rewritten'}", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
