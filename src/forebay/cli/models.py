"""``forebay models``: a model repository listed, shown, checked, collected, compacted,
imported and exported, and served over TCP."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

from .._units import human_bytes, parse_size
from ._args import nonneg_float, positive_int, progress

__all__ = ["register"]


def _log_without_blocking() -> Any:
    """Log records to stderr from one thread, through a bounded queue: a stderr nobody
    reads (a full pipe) stalls that thread only, never a provider's handlers (they
    drop records while the queue is full).  Returns a function that flushes what it can
    within 2 s and stops the thread; it returns False if the thread is stuck on stderr."""
    import logging
    import logging.handlers
    import queue
    import threading

    class Dropping(logging.handlers.QueueHandler):
        def enqueue(self, record: logging.LogRecord) -> None:
            try:
                self.queue.put_nowait(record)
            except queue.Full:
                pass                    # the log is behind: this record is dropped

    q: "queue.Queue[Optional[logging.LogRecord]]" = queue.Queue(10_000)
    out = logging.StreamHandler(sys.stderr)
    out.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))

    def write() -> None:
        while (record := q.get()) is not None:
            out.handle(record)

    t = threading.Thread(target=write, name="forebay-log", daemon=True)
    t.start()
    handler = Dropping(q)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(handler)

    def stop() -> bool:
        root.removeHandler(handler)
        try:
            q.put(None, timeout=2)
        except queue.Full:
            return False
        t.join(timeout=2)
        return not t.is_alive()

    return stop

def cmd_models_serve(a: argparse.Namespace) -> int:
    import os

    stop_log = _log_without_blocking()
    code = 2
    try:
        code = _serve_models(a)       # the store is closed when this returns
    finally:
        if not stop_log():
            # stderr is a pipe nobody reads: the interpreter's own flush at exit would
            # wait on it forever; everything else is done
            sys.stdout.flush()
            os._exit(code)
    return code

def _serve_models(a: argparse.Namespace) -> int:
    from ..models import serve, token_from_file
    from ._args import token_refused

    token = token_from_file(a.token_file)
    if token_refused(token, a.no_token, "forebay models serve"):
        return 2
    try:
        serve(a.listen, a.store, token, workers=a.workers, max_data=a.max_frame,
              allow_no_token=a.no_token,
              ready=lambda srv: print(f"serving {a.store} on {srv.address}", flush=True))
    except KeyboardInterrupt:
        pass
    return 0

def cmd_models(a: argparse.Namespace) -> int:
    from ..models import open_repository
    from ..models import token_from_file

    repo = open_repository(a.url, token_from_file(getattr(a, "token_file", None)),
                           create=a.models_command == "import")
    try:
        if a.models_command == "import":
            from ..models import import_safetensors

            v = import_safetensors(repo, a.file, a.name)
            m = repo.manifest(a.name, v)
            print(f"{a.name} version {v}: {len(m['tensors'])} tensors, "
                  f"{human_bytes(m['logical_bytes'])} ({human_bytes(m['new_bytes'])} new)")
        elif a.models_command == "export":
            from ..models import export_safetensors

            out = export_safetensors(repo, a.name, a.file, a.version,
                                     a.include.split(",") if a.include else None)
            print(f"wrote {out}")
        elif a.models_command == "ls":
            listing = repo.list()
            if not listing:
                print(f"{repo.url}: no models")
            for name, vs in sorted(listing.items()):
                m = repo.manifest(name, vs[-1])
                print(f"{name:<32} versions {vs[0]}..{vs[-1]} ({len(vs)})  latest: "
                      f"{len(m['tensors'])} tensors, {human_bytes(m['logical_bytes'])}, "
                      f"{m['created'][:19]}")
            st = repo.stats()
            print(f"store: {st['tensors']} tensors, {human_bytes(st['stored_bytes'])} stored for "
                  f"{human_bytes(st['logical_bytes'])} of versions")
            fb = st.get("file_bytes")
            if fb is not None and fb > 2 * st["stored_bytes"] + (64 << 20):
                print(f"data file: {human_bytes(fb)}, mostly pages freed by deleted versions; "
                      f"`forebay models compact` writes a copy without them")
        elif a.models_command == "show":
            m = repo.manifest(a.name, a.version)
            if a.json:
                print(json.dumps(m, indent=1))
                return 0
            g = m["graph"]
            parent = f"parent {m['parent']}" if m['parent'] is not None else "no parent"
            print(f"{m['name']} version {m['version']} ({parent}), created "
                  f"{m['created'][:19]}, metadata {json.dumps(m['metadata'])}")
            print(f"  {len(m['tensors'])} tensors, {human_bytes(m['logical_bytes'])}; "
                  f"{human_bytes(m['new_bytes'])} new in this version")
            if g is not None:
                print(f"  {len(g['nodes'])} leaf layers, edges from {g['source']}:")
                for k, node in enumerate(g["nodes"]):
                    ins = ",".join(map(str, node["inputs"])) or "-"
                    print(f"  {k:>4} {node['name'] or '(root)':<40} <- {ins:<12} "
                          f"id {node['id'][:16]}")
        elif a.models_command == "verify":
            problems = repo.verify()
            for p in problems:
                print(f"CORRUPT {p}", file=sys.stderr)
            if problems:
                return 1
            st = repo.stats()
            print(f"ok: {st['versions']} versions of {st['models']} models, "
                  f"{st['tensors']} tensors ({human_bytes(st['stored_bytes'])}) checked")
        elif a.models_command == "gc":
            r = repo.gc(grace_seconds=a.grace_hours * 3600)
            print(f"removed {r['tensors_removed']} tensors ({human_bytes(r['bytes_freed'])}), "
                  f"{r['stale_saves']} records of crashed saves")
        elif a.models_command == "compact":
            r = repo.compact(a.dest, progress=progress())
            print(f"{a.dest}: {human_bytes(r['bytes_after'])} (was "
                  f"{human_bytes(r['bytes_before'])}); {r['tensors_located']} tensors "
                  f"located, {r['manifests_rewritten']} manifests rewritten")
        elif a.models_command == "relocate":
            r = repo.relocate(progress=progress())
            print(f"{r['tensors_located']} tensors located, {r['manifests_rewritten']} "
                  f"manifests rewritten")
    finally:
        repo.close()
    return 0


def register(sub: Any) -> None:
    """Add this group's commands to the ``forebay`` parser."""
    mo = sub.add_parser("models", help="model repository: list, show, verify, gc, compact, "
                        "import/export safetensors, serve")
    mos = mo.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    ml = mos.add_parser("ls", help="models and versions")
    ml.add_argument("url", help="repository: file:///path, a path")
    ms = mos.add_parser("show", help="a version's metadata and architecture graph")
    ms.add_argument("url")
    ms.add_argument("name")
    ms.add_argument("--version", type=positive_int, help="default: the latest")
    ms.add_argument("--json", action="store_true", help="the whole manifest")
    mv = mos.add_parser("verify", help="check every stored tensor; exit 1 on corruption")
    mv.add_argument("url")
    mg = mos.add_parser("gc", help="delete tensors no version references")
    mg.add_argument("url")
    mg.add_argument("--grace-hours", type=nonneg_float, default=6.0,
                    help="spare saves in progress younger than this (default 6)")
    mc = mos.add_parser("compact", help="write a copy without free pages (after gc), with "
                        "fresh tensor locations")
    mc.add_argument("url", help="an LMDB repository (file:///path or a path)")
    mc.add_argument("dest", help="a new or empty directory for the copy")
    mr = mos.add_parser("relocate", help="find every tensor's file location again (after "
                        "the store's file was rewritten by a copy)")
    mr.add_argument("url")
    mi = mos.add_parser("import", help="store a .safetensors file as the next version of NAME")
    mi.add_argument("url", help="repository (created if missing)")
    mi.add_argument("file")
    mi.add_argument("name")
    mx = mos.add_parser("export", help="write a version to a .safetensors file")
    mx.add_argument("url")
    mx.add_argument("name")
    mx.add_argument("file")
    mx.add_argument("--version", type=positive_int, help="default: the latest")
    mx.add_argument("--include", help="comma-separated tensor names or patterns")
    for q in (ml, ms, mv, mg, mc, mr, mi, mx):
        q.set_defaults(func=cmd_models)
        q.add_argument("--token-file", help="shared token for tcp:// providers "
                       "(default: FOREBAY_TOKEN)")
    sv = mos.add_parser("serve", help="serve a repository to clients over TCP (tcp://)")
    sv.add_argument("--listen", default="127.0.0.1:7531", help="HOST:PORT (default "
                    "127.0.0.1:7531)")
    sv.add_argument("--store", required=True, help="the repository served: file:///path "
                    "or memory://")
    sv.add_argument("--token-file", help="file whose first line is the shared token "
                    "(default: FOREBAY_TOKEN; one is required)")
    sv.add_argument("--no-token", action="store_true",
                    help="serve without a token: anyone who can reach the port may read, "
                         "write and delete models")
    sv.add_argument("--workers", type=positive_int, default=16, help="clients served at once")
    sv.add_argument("--max-frame", type=parse_size, default="16GiB",
                    help="largest request accepted (default 16GiB)")
    sv.set_defaults(func=cmd_models_serve)
