"""Writes the core's state diagram (`agentruns.processors.diagram`) into a document.

``python -m agentruns.connectors.diagram_doc --write docs/design.md`` replaces the block between
the markers; ``python -m agentruns.connectors.diagram_doc`` prints it. The file and argument
handling lives here so that the core stays free of I/O.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agentruns.processors.diagram import mermaid, render_into


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentruns.connectors.diagram_doc")
    parser.add_argument("--write", metavar="DOC", help="replace the block in this document")
    args = parser.parse_args(argv)
    if args.write is None:
        print(mermaid())
        return 0
    path = Path(args.write)
    path.write_text(render_into(path.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
