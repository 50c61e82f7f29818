"""How every ``elastic-plugin`` subcommand reports bad input: one line on stderr, exit code 2.

Exit 2 is what argparse uses for a bad command line, so a script sees the same code whether a
flag failed to parse or its value failed a later check (raised as ``ConfigError`` before any
expensive work). Kept free of torch imports: CLIs validate before loading Megatron.
"""

from __future__ import annotations

import sys

EXIT_BAD_INPUT = 2

__all__ = ["EXIT_BAD_INPUT", "report_bad_input"]


def report_bad_input(prog: str, exc: Exception) -> int:
    """Print ``PROG: error: <exc>`` to stderr; return :data:`EXIT_BAD_INPUT`."""
    print(f"{prog}: error: {exc}", file=sys.stderr)
    return EXIT_BAD_INPUT
