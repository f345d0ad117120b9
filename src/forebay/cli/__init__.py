"""The ``forebay`` command: one module per group of commands (``data``: synth, ingest,
info, verify, dlio-configs; ``sim``: plan, simulate, calibrate; ``trace``: analyze, trace
export; ``models``: the model repository), each adding its parsers with ``register``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from .._units import parse_size
from .._version import __version__
from ..errors import ChecksumError, ForebayError

__all__ = ["main", "build_parser", "parse_size"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="forebay", description="Keep accelerators fed on HPC systems: "
                                "packed datasets, distributed in-memory stores, clairvoyant "
                                "caching.")
    p.add_argument("--version", action="version", version=f"forebay {__version__}")
    from . import data, models, sim, trace      # numpy and the rest: see main()

    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in (data, sim, trace, models):
        group.register(sub)
    return p


#: optional dependencies -> the pip extra that brings them (pyproject.toml)
_EXTRAS = {"lmdb": "models", "msgpack": "models", "safetensors": "models",
           "matplotlib": "plots", "torch": "torch", "mpi4py": "mpi", "pyarrow": "sources",
           "zarr": "sources"}


#: what matplotlib's Agg backend writes, by file name
_IMAGE_TYPES = ("png", "pdf", "svg", "jpg", "jpeg", "eps", "ps", "tif", "tiff", "webp")


def _check_outputs(args: argparse.Namespace) -> None:
    """Output files (``--json``, ``--plot``, ``--html``) go into directories that exist
    and can be written, and name files (an image type for ``--plot``): checked before
    any work, not after it."""
    import os

    from ..errors import InvalidArgumentError

    for attr in ("json", "plot", "html"):
        v = getattr(args, attr, None)
        if not v or not isinstance(v, (str, os.PathLike)):
            continue
        if str(v).endswith(("/", os.sep)) or Path(v).is_dir():
            raise InvalidArgumentError(f"--{attr} {v!r} is a folder: give a file name in it")
        if attr == "plot" and Path(v).suffix.lstrip(".").lower() not in _IMAGE_TYPES:
            raise InvalidArgumentError(f"--plot {v!r}: the name must end in one of "
                                       f"{', '.join('.' + k for k in _IMAGE_TYPES)}")
        parent = Path(v).resolve().parent
        if not parent.is_dir():
            raise InvalidArgumentError(f"--{attr} {v}: no directory {parent} to write it in")
        if not os.access(parent, os.W_OK):
            raise InvalidArgumentError(f"--{attr} {v}: {parent} is not writable")


def _sigterm_as_interrupt() -> None:
    """SIGTERM (what Slurm and a timeout send) as Ctrl-C: the command stops the same
    way, removing what it had half written, instead of dying where it stands."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        parser = build_parser()     # the imports: a Ctrl-C there is one line too
    except KeyboardInterrupt:
        print("forebay: interrupted", file=sys.stderr)
        return 130
    args = parser.parse_args(argv)
    if argv is None:           # the forebay command itself (not a library call of main)
        _sigterm_as_interrupt()
    import warnings

    def one_line(message: Any, category: Any, *rest: Any, **kw: Any) -> None:
        print(f"forebay {args.command}: warning: {message}", file=sys.stderr)

    try:
        _check_outputs(args)
        with warnings.catch_warnings():
            warnings.showwarning = one_line      # a line of the command's, not Python's
            return args.func(args)
    except ChecksumError as e:
        print(f"forebay: CORRUPT: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # the reader went away (`forebay info x | head`): not an error; keep Python's
        # own flush at exit from complaining about the closed pipe
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (ForebayError, OSError) as e:
        # what the user can fix (a bad argument, a missing file, a refused path): one
        # line; anything else is a bug in forebay and shows its traceback
        print(f"forebay {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in _EXTRAS:
            raise
        print(f"forebay {args.command}: error: this needs the {top!r} package, not "
              f"installed here: pip install 'forebay[{_EXTRAS[top]}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("forebay: interrupted", file=sys.stderr)
        return 130

