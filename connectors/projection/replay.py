"""`agentruns replay RUN_ID [--json]`: a run's timeline from the event log alone (R28).

The implementation lives in `agentruns.connectors.projection.audit`; this module gives the CLI its
`main`.
"""

from __future__ import annotations

import sys

from agentruns.connectors.projection.audit import replay_main as main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
