"""A model provider: ``forebay models serve`` answers the ``tcp://`` client's frames
(see :mod:`._wire`) from a repository, each connection in a thread of its own."""

from __future__ import annotations

import hmac
import logging
import socket
import socketserver
import threading
from typing import Any, Optional

import numpy as np

from ..errors import CorruptModelError, ModelNotFoundError, ModelRepositoryError
from ._repo import Repository
from ._store import PENDING_GRACE_S
from ._tensors import tensor_hash
from ._wire import (DEFAULT_MAX_DATA, HANDSHAKE_TIMEOUT_S, HELLO_MAX, OP, VERSION, ProtocolError,
                    _drain, _recv_exact, _recv_header, _recv_into, _send, _unpackb,
                    parse_addresses)
from ._open import open_repository

__all__ = ["Provider", "serve"]

log = logging.getLogger("forebay.models.provider")


class Provider(socketserver.ThreadingTCPServer):
    """Serves one repository (LMDB or memory) to many clients; ``workers`` bounds the
    connections served at once (the rest wait in the listen queue)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, listen: tuple[str, int], repo: Repository, token: Optional[str],
                 *, workers: int = 16, max_data: int = DEFAULT_MAX_DATA,
                 idle_timeout: float = 600.0, allow_no_token: bool = False) -> None:
        self.repo, self.token = repo, token or ""
        if not self.token and not allow_no_token:
            raise ModelRepositoryError("a provider needs a token; pass allow_no_token=True "
                                       "to serve anyone")
        self.max_data, self.idle_timeout = max_data, idle_timeout
        self.slots = threading.BoundedSemaphore(workers)
        self.served = 0
        super().__init__(listen, _Handler)

    @property
    def address(self) -> str:
        host, port = self.server_address[:2]
        return f"tcp://{host!s}:{port}"


class _Handler(socketserver.BaseRequestHandler):
    server: Provider
    _data_left = 0      # bytes of the current request's data not read yet

    def handle(self) -> None:
        sock: socket.socket = self.request
        peer = f"{self.client_address[0]}:{self.client_address[1]}"
        try:
            self._serve(sock)
        except ProtocolError as e:
            log.warning("%s: %s; dropping the client", peer, e)
            try:
                _send(sock, OP["ERR"], {"error": str(e), "kind": "protocol"})
            except OSError:
                pass
        except (ConnectionError, socket.timeout, OSError) as e:
            log.info("%s: %s; dropping the client", peer, e)

    def _serve(self, sock: socket.socket) -> None:
        """The handshake (a small HELLO within seconds, no worker slot held), then each
        request served holding one of the ``workers`` slots, released while the
        connection is idle: unauthenticated or idle connections never starve others."""
        srv = self.server
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        op, mlen, dlen = _recv_header(sock, 0, HELLO_MAX)
        meta = _unpackb(_recv_exact(sock, mlen))
        if op != OP["HELLO"] or not isinstance(meta, dict):
            raise ProtocolError("the first frame must be HELLO")
        if not hmac.compare_digest(str(meta.get("token", "")).encode(), srv.token.encode()):
            _send(sock, OP["ERR"], {"error": "wrong token", "kind": "auth"})
            log.warning("%s: wrong token", self.client_address[0])
            return
        _send(sock, OP["OK"], {"version": VERSION})
        sock.settimeout(srv.idle_timeout)
        while True:
            try:
                op, mlen, dlen = _recv_header(sock, srv.max_data)
            except ConnectionError:
                return  # the client closed between requests
            with srv.slots:
                meta = _unpackb(_recv_exact(sock, mlen))
                if not isinstance(meta, dict):
                    raise ProtocolError("frame metadata must be a map")
                self._data_left = dlen
                try:
                    self._dispatch(sock, op, meta, dlen)
                except ProtocolError:
                    raise
                except Exception as e:  # noqa: BLE001 - every malformed request gets an ERR
                    # the request's data not read yet is read and dropped: the next frame
                    # starts where the client thinks it does
                    _drain(sock, self._data_left)
                    kind = "notfound" if isinstance(e, ModelNotFoundError) else \
                        "corrupt" if isinstance(e, CorruptModelError) else "error"
                    msg = str(e) if isinstance(e, ModelRepositoryError) else \
                        f"malformed request ({type(e).__name__}: {e})"
                    _send(sock, OP["ERR"], {"error": msg, "kind": kind})

    def _dispatch(self, sock: socket.socket, op: int, meta: dict, dlen: int) -> None:
        repo = self.server.repo
        if op != OP["PUT"] and dlen:
            raise ProtocolError(f"op {op} carries no data, got {dlen} bytes")
        if op == OP["HAS"]:
            _send(sock, OP["OK"], {"missing": repo.missing(list(meta["hashes"]))})
        elif op == OP["PUT"]:
            self._put(sock, meta, dlen)
        elif op == OP["COMMIT"]:
            body = meta["body"]
            if not isinstance(body, dict) or not isinstance(body.get("tensors"), dict) or \
                    not all(isinstance(e, dict) and isinstance(e.get("hash"), str)
                            for e in body["tensors"].values()):
                raise ProtocolError("COMMIT body malformed: a map whose 'tensors' maps "
                                    "state keys to entries with a 'hash'")
            v = repo.commit(meta["name"], body, bytes(meta["token"]), meta.get("parent"))
            _send(sock, OP["OK"], {"version": v})
        elif op == OP["MANIFEST"]:
            _send(sock, OP["OK"], {"manifest": repo.manifest(meta["name"], meta.get("version"))})
        elif op == OP["GET"]:
            with repo.read_tensors(list(meta["hashes"])) as bufs:
                _send(sock, OP["OK"], {"sizes": [len(b) for b in bufs]}, bufs)
        elif op == OP["VERSIONS"]:
            _send(sock, OP["OK"], {"versions": repo.versions(meta["name"])})
        elif op == OP["LIST"]:
            _send(sock, OP["OK"], {"models": repo.list()})
        elif op == OP["DELETE"]:
            repo.delete(meta["name"], int(meta["version"]))
            _send(sock, OP["OK"], {})
        elif op == OP["GC"]:
            _send(sock, OP["OK"], repo.gc(float(meta.get("grace_seconds", PENDING_GRACE_S))))
        elif op == OP["VERIFY"]:
            _send(sock, OP["OK"], {"problems": repo.verify()})
        elif op == OP["STATS"]:
            st = repo.stats()
            _send(sock, OP["OK"], {k: st[k] for k in ("models", "versions", "tensors",
                                                      "logical_bytes", "stored_bytes",
                                                      "file_bytes") if k in st})
        else:
            raise ProtocolError(f"unknown op {op}")

    def _put(self, sock: socket.socket, meta: dict, dlen: int) -> None:
        """Receive each tensor into a buffer of its own, verify every hash (a client is
        not trusted), then store them under a pending record (a memory store keeps the
        buffers: no second copy)."""
        items = meta["tensors"]
        sizes = [int(t["nbytes"]) for t in items]
        if sum(sizes) != dlen or any(s < 0 for s in sizes):
            raise ProtocolError(f"PUT announces {sum(sizes)} bytes of tensors, frame has {dlen}")
        blobs, bad = {}, None
        for t, n in zip(items, sizes):
            data = np.empty(n, dtype=np.uint8)   # its own buffer: a memory store keeps it
            _recv_into(sock, data.data)
            self._data_left -= n
            if bad is None and tensor_hash(str(t["dtype"]), t["shape"], data) != t["hash"]:
                bad = t["hash"]                  # read the rest: the connection stays usable
            blobs[t["hash"]] = data
        if bad is not None:
            raise CorruptModelError(f"tensor {str(bad)[:16]} arrived corrupt (its bytes "
                                    f"do not match its hash); nothing stored")
        token, written = self.server.repo.put_tensors(blobs, owned=True)
        _send(sock, OP["OK"], {"token": token, "written": written})


def serve(listen: str, store_url: str, token: Optional[str], *, workers: int = 16,
          max_data: int = DEFAULT_MAX_DATA, ready: Any = None,
          allow_no_token: bool = False) -> None:
    """Run a provider until interrupted (``forebay models serve``).  A token is
    required (127.0.0.1 is reachable by every user of the node) unless
    ``allow_no_token``."""

    if not token and not allow_no_token:
        raise ModelRepositoryError("a provider needs a token (any user who can reach its "
                                   "port could read, write and delete models); pass "
                                   "allow_no_token=True to serve anyone")

    host, port = parse_addresses(listen if listen.startswith("tcp://") else
                                 f"tcp://{listen}")[0]
    if store_url.startswith("tcp://"):
        raise ModelRepositoryError("a provider serves a local store (file:// or memory://)")
    repo = open_repository(store_url)
    assert isinstance(repo, Repository)   # a local store: tcp:// was refused above
    with Provider((host, port), repo, token, workers=workers, max_data=max_data,
                  allow_no_token=allow_no_token) as srv:
        log.warning("serving %s on %s (%d workers%s)", repo.url, srv.address, workers,
                    ", token required" if token else ", NO token")
        if ready is not None:
            ready(srv)
        try:
            srv.serve_forever()
        finally:
            repo.close()


# -- the client -------------------------------------------------------------------------------
