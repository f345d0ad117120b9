"""Entry point of every rank of a multi-rank test: ``python rank_main.py MODULE FUNC
ARGS...`` imports test module MODULE and calls ``FUNC(*ARGS)`` (see
:func:`conftest.run_ranks`).  A rank whose function returns prints ``rank-main: rank R ok``; an
exception leaves it uncaught, as in a user's script (forebay's abort-on-error hook,
when installed, sees it)."""

from __future__ import annotations

import importlib
import os
import sys


def main() -> int:
    module, func, *args = sys.argv[1:]
    rank = os.environ.get("PMI_RANK") or os.environ.get("RANK") or "0"
    getattr(importlib.import_module(module), func)(*args)
    os.write(1, f"rank-main: rank {rank} ok\n".encode())
    if os.environ.get("RANK_MAIN_EXIT_AT_ONCE") == "1":
        # skip interpreter teardown, where torch's DCP/gloo threads now and then abort
        # the process ("terminate called without an active exception") after all the
        # work succeeded; only for tests that ask for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
