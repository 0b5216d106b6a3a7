"""The `rootrank` command of the Python package (`pip install rootrank-*.whl` puts it on PATH):
`serve`, `why`, `status`, `watch`, `node-watch` and `run`, the same code as the `rootrank`
binary built with cargo (the NIXL subcommands `demo` and `simulate` are the binary's only).
It runs in a process of its own; importing `rootrank` elsewhere never runs it."""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from rootrank._rootrank import cli

    args = list(sys.argv if argv is None else argv)
    args[0] = "rootrank"
    # The Rust side takes SIGINT/SIGTERM for itself where a subcommand needs them (serve
    # stops cleanly, run forwards them to its child); Python's own handler would never run
    # while it does.
    return int(cli(args))


if __name__ == "__main__":
    sys.exit(main())
