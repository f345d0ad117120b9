"""Entry point of every rank of a multi-rank test: ``python rank_main.py MODULE FUNC
ARGS...`` imports test module MODULE and calls ``FUNC(*ARGS)`` (see
:func:`conftest.run_ranks`).  A rank whose function returns prints ``rank R ok``; one
that raises prints the traceback and exits 1."""

from __future__ import annotations

import importlib
import os
import sys
import traceback


def main() -> int:
    module, func, *args = sys.argv[1:]
    rank = os.environ.get("PMI_RANK") or os.environ.get("RANK") or "0"
    try:
        getattr(importlib.import_module(module), func)(*args)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    os.write(1, f"rank {rank} ok\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
