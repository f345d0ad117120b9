"""Model providers over TCP: ``forebay models serve`` and the ``tcp://`` client.

Wire format: every message is one frame ::

    header  20 bytes  "!4sBBHIQ": magic b"FBM1", protocol version 1, op, flags (0),
                      metadata length, data length
    meta    msgpack   a map (never pickle)
    data    raw       tensor bytes, back to back in the order the meta lists them

The first frame of a connection is HELLO with the shared token (compared in constant
time).  Frames over the provider's limits, bad magic, unknown ops and malformed
metadata get an ERR frame and the connection is closed; a client that disconnects
mid-frame is dropped; the provider keeps serving everyone else.  Tensor data is sent
scatter-gather from the store's pages and received with ``recv_into`` straight into
the destination tensors (or a staging buffer, pinned when CUDA is present, for GPU
destinations); the client verifies every tensor against its hash.
"""

from __future__ import annotations

import builtins
import hmac
import logging
import os
import socket
import socketserver
import struct
import threading
from typing import Any, Optional, Sequence

import numpy as np
import xxhash

from ..errors import (ConnectionClosedError, CorruptModelError, ModelNotFoundError,
                      ModelRepositoryError)
from ._repo import PENDING_GRACE_S, ModelStore, Repository, _copy_into, tensor_hash

__all__ = ["serve", "RemoteRepository", "Provider", "HEADER", "parse_addresses"]

log = logging.getLogger("forebay.models.provider")

HEADER = struct.Struct("!4sBBHIQ")
MAGIC, VERSION = b"FBM1", 1
OP = {"HELLO": 1, "HAS": 2, "PUT": 3, "COMMIT": 4, "MANIFEST": 5, "GET": 6, "VERSIONS": 7,
      "LIST": 8, "DELETE": 9, "GC": 10, "VERIFY": 11, "STATS": 12, "OK": 100, "ERR": 101}
MAX_META = 64 << 20
DEFAULT_MAX_DATA = 16 << 30
#: before the token is checked only a small HELLO is read, within this many seconds
HELLO_MAX = 4096
HANDSHAKE_TIMEOUT_S = 10.0
#: msgpack container limits for metadata (a manifest of 100k tensors fits)
_UNPACK_LIMITS = dict(max_array_len=1 << 20, max_map_len=1 << 20, max_str_len=1 << 20,
                      max_bin_len=1 << 20, max_ext_len=0)


class ProtocolError(ModelRepositoryError):
    """A malformed, oversized or unexpected frame."""


def _packb(obj: Any) -> bytes:
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)


def _unpackb(raw: bytes) -> Any:
    import msgpack

    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as e:  # msgpack raises several kinds on garbage
        raise ProtocolError(f"malformed frame metadata: {type(e).__name__}") from e


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionClosedError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, the buffer growing as they arrive (a header announcing 64 MiB
    allocates nothing until the bytes come)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionClosedError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _drain(sock: socket.socket, n: int) -> None:
    """Read ``n`` bytes and drop them, 1 MiB at a time."""
    buf = bytearray(min(n, 1 << 20))
    while n > 0:
        got = sock.recv_into(buf, min(n, len(buf)))
        if got == 0:
            raise ConnectionClosedError(f"connection closed with {n} bytes of a request left")
        n -= got


def _send(sock: socket.socket, op: int, meta: Any, data: Sequence[Any] = ()) -> None:
    """One frame, scatter-gather: header, meta and every data buffer in sendmsg calls."""
    m = _packb(meta)
    bufs = [memoryview(b).cast("B") for b in data]
    total = sum(len(b) for b in bufs)
    out = [memoryview(HEADER.pack(MAGIC, VERSION, op, 0, len(m), total)), memoryview(m)]
    out += [b for b in bufs if len(b)]
    while out:
        sent = sock.sendmsg(out[:512])
        while sent:
            if sent >= len(out[0]):
                sent -= len(out[0])
                out.pop(0)
            else:
                out[0] = out[0][sent:]
                sent = 0


def _recv_header(sock: socket.socket, max_data: int, max_meta: int = MAX_META
                 ) -> tuple[int, int, int]:
    raw = _recv_exact(sock, HEADER.size)
    magic, ver, op, _flags, mlen, dlen = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a forebay model client")
    if ver != VERSION:
        raise ProtocolError(f"protocol version {ver}, this side speaks {VERSION}")
    if mlen > max_meta:
        raise ProtocolError(f"frame metadata of {mlen} bytes exceeds the {max_meta} limit")
    if dlen > max_data:
        raise ProtocolError(f"frame data of {dlen} bytes exceeds the {max_data} limit")
    return op, mlen, dlen


def parse_addresses(url: str) -> list[tuple[str, int]]:
    """``tcp://host:port[,host:port...]`` -> [(host, port)]."""
    rest = url[len("tcp://"):] if url.startswith("tcp://") else url
    out = []
    for part in rest.split(","):
        part = part.strip()
        part = part[len("tcp://"):] if part.startswith("tcp://") else part
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ModelRepositoryError(f"{url}: expected tcp://host:port[,host:port...]")
        out.append((host, int(port)))
    return out


# -- the provider -----------------------------------------------------------------------------
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
    from ._repo import open_repository

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
class _Conn:
    def __init__(self, addr: tuple[str, int], token: str, timeout: float) -> None:
        self.addr, self.token, self.timeout = addr, token, timeout
        self.sock: Optional[socket.socket] = None
        self.lock = threading.Lock()

    def _connect(self) -> socket.socket:
        try:
            s = socket.create_connection(self.addr, timeout=self.timeout)
        except OSError as e:
            raise ModelRepositoryError(f"cannot reach the model provider at "
                                       f"{self.addr[0]}:{self.addr[1]}: {e}") from e
        s.settimeout(self.timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _send(s, OP["HELLO"], {"token": self.token, "version": VERSION})
        op, meta, _ = self._read(s)
        if op != OP["OK"]:
            s.close()
            raise ModelRepositoryError(f"provider {self.addr[0]}:{self.addr[1]} refused the "
                                       f"connection: {meta.get('error')}")
        return s

    @staticmethod
    def _read(s: socket.socket) -> tuple[int, dict, int]:
        op, mlen, dlen = _recv_header(s, 1 << 62)
        meta = _unpackb(_recv_exact(s, mlen))
        return op, meta, dlen

    def call(self, op: str, meta: dict, data: Sequence[Any] = (), sink: Any = None) -> dict:
        """One request; ``sink(sock, meta, dlen)`` receives a reply's data."""
        with self.lock:
            if self.sock is None:
                self.sock = self._connect()
            try:
                _send(self.sock, OP[op], meta, data)
                rop, rmeta, dlen = self._read(self.sock)
                if rop == OP["ERR"]:
                    if dlen:
                        _recv_exact(self.sock, dlen)
                    kind, msg = rmeta.get("kind"), rmeta.get("error", "error")
                    if kind == "protocol":
                        self.close()
                    err: type[ModelRepositoryError] = {
                        "notfound": ModelNotFoundError, "corrupt": CorruptModelError,
                    }.get(str(kind), ModelRepositoryError)
                    raise err(msg)
                if sink is not None:
                    try:
                        sink(self.sock, rmeta, dlen)
                    except BaseException:
                        self.close()   # the rest of the reply is unread: out of step
                        raise
                elif dlen:
                    _recv_exact(self.sock, dlen)
                return rmeta
            except (OSError, ConnectionError) as e:
                self.close()
                raise ModelRepositoryError(f"model provider {self.addr[0]}:{self.addr[1]}: "
                                           f"{e}") from e

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None

    def __del__(self) -> None:  # a client dropped without close(): no leaked socket
        try:
            self.close()
        except Exception:
            pass


class RemoteRepository(ModelStore):
    """The client of one or more providers: each model name lives on the provider that
    rendezvous hashing picks (stable when providers are added: only names whose
    highest-scoring provider is the new one move).  Architecture capture, hashing and
    the ID cache stay client-side; tensors the provider already holds are not sent."""

    def __init__(self, url: str, token: Optional[str] = None, timeout: float = 300.0) -> None:
        super().__init__(url)
        self.addrs = parse_addresses(url)
        self.token = token or ""
        self.conns = [_Conn(a, self.token, timeout) for a in self.addrs]

    def provider_for(self, name: str) -> int:
        """Index of the provider holding ``name`` (highest rendezvous score)."""
        scores = [xxhash.xxh64_intdigest(f"{h}:{p}|{name}".encode()) for h, p in self.addrs]
        return int(np.argmax(scores))

    def _conn(self, name: str) -> _Conn:
        return self.conns[self.provider_for(name)]

    # -- save ---------------------------------------------------------------------------
    def _store_tensors(self, name: str, blobs: dict[str, Any], kinds: Optional[dict] = None,
                       new: Optional[set] = None, owned: bool = False) -> tuple[bytes, int]:
        """Ask ``name``'s provider which tensors it lacks, send only those (it re-hashes
        them; file locations are the provider's business: ``new`` stays empty)."""
        c = self._conn(name)
        missing = set(c.call("HAS", {"hashes": list(blobs)})["missing"])
        self._io["tensors_deduplicated"] += len(blobs) - len(missing)
        send = [(h, blobs[h]) for h in blobs if h in missing]
        meta = {"tensors": [{"hash": h, "nbytes": int(d.nbytes), **(kinds or {})[h]}
                            for h, d in send]}
        r = c.call("PUT", meta, [d for _, d in send])
        self._io["tensors_written"] += len(send)
        self._io["bytes_written"] += int(r["written"])
        return bytes(r["token"]), int(r["written"])

    def _publish(self, name: str, body: dict[str, Any], token: bytes,
                 parent: Optional[int], locs: Optional[dict[str, int]] = None) -> int:
        return int(self._conn(name).call("COMMIT", {"name": name, "body": body,
                                                    "token": token, "parent": parent})["version"])

    # -- read side ----------------------------------------------------------------------
    def manifest(self, name: str, version: Optional[int] = None) -> dict[str, Any]:
        return self._conn(name).call("MANIFEST", {"name": name, "version": version})["manifest"]

    def versions(self, name: str) -> builtins.list[int]:
        return list(self._conn(name).call("VERSIONS", {"name": name})["versions"])

    def list(self) -> dict[str, builtins.list[int]]:
        out: dict[str, builtins.list[int]] = {}
        for c in self.conns:
            out.update(c.call("LIST", {})["models"])
        return out

    def _fetch(self, m: dict[str, Any], pairs: builtins.list[tuple[str, Any]],
               fresh: bool = False) -> None:
        """One GET for all the tensors; each received straight into its destination's
        memory (CPU, contiguous) or a staging buffer, then verified (``fresh`` does not
        change how).  The whole reply is read before a corrupt tensor is reported, so
        the connection stays in step for the next request."""
        import torch

        entries = [m["tensors"][k] for k, _ in pairs]
        bad: builtins.list[str] = []

        def sink(sock: socket.socket, meta: dict, dlen: int) -> None:
            sizes = meta["sizes"]
            if len(sizes) != len(pairs) or sum(sizes) != dlen:
                raise ProtocolError("GET reply does not match the request")
            for (k, dst), e, n in zip(pairs, entries, sizes):
                if n != e["nbytes"]:
                    raise CorruptModelError(f"model {m['name']!r} version {m['version']}: "
                                            f"tensor {k!r}: {n} bytes served, {e['nbytes']} "
                                            f"expected")
                direct = dst.device.type == "cpu" and dst.is_contiguous() and \
                    e["dtype"] != "bool"
                if direct:
                    view = dst.detach().reshape(-1).view(torch.uint8).numpy()
                else:
                    view = _staging(n)
                _recv_into(sock, memoryview(view)[:n] if n else memoryview(b""))
                if tensor_hash(e["dtype"], e["shape"], view[:n]) != e["hash"]:
                    bad.append(repr(k))
                    continue
                if not direct:
                    _copy_into(dst, view[:n], e["dtype"])
                self._io["bytes_read"] += n
                self._io["tensors_read"] += 1

        self._conn(m["name"]).call("GET", {"hashes": [e["hash"] for e in entries]},
                                   sink=sink)
        if bad:
            raise CorruptModelError(f"model {m['name']!r} version {m['version']}: tensor "
                                    f"{', '.join(bad[:5])}{' and others' if len(bad) > 5 else ''}"
                                    f" arrived corrupt (the provider's stored bytes do not "
                                    f"match their hash)")

    # -- housekeeping -------------------------------------------------------------------
    def delete(self, name: str, version: int) -> None:
        self._conn(name).call("DELETE", {"name": name, "version": version})

    def gc(self, grace_seconds: float = PENDING_GRACE_S) -> dict[str, int]:
        tot: dict[str, int] = {}
        for c in self.conns:
            for k, v in c.call("GC", {"grace_seconds": grace_seconds}).items():
                tot[k] = tot.get(k, 0) + int(v)
        return tot

    def verify(self) -> builtins.list[str]:
        return [p for c in self.conns for p in c.call("VERIFY", {})["problems"]]

    def stats(self) -> dict[str, Any]:
        tot: dict[str, Any] = {}
        for c in self.conns:
            for k, v in c.call("STATS", {}).items():
                tot[k] = tot.get(k, 0) + v
        return {**tot, "providers": len(self.conns),
                "id_cache": {"hits": self.cache.hits, "misses": self.cache.misses}, **self._io}

    def close(self) -> None:
        try:
            self._end_saves()
        finally:
            for c in self.conns:
                c.close()


_stage_local = threading.local()


def _staging(n: int) -> np.ndarray:
    """A reusable receive buffer of at least ``n`` bytes (pinned when CUDA is there)."""
    buf = getattr(_stage_local, "buf", None)
    if buf is None or len(buf) < n:
        try:
            import torch

            if torch.cuda.is_available():
                buf = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=True).numpy()
            else:
                buf = np.empty(max(n, 1), dtype=np.uint8)
        except ImportError:  # pragma: no cover
            buf = np.empty(max(n, 1), dtype=np.uint8)
        _stage_local.buf = buf
    return buf


def token_from_file(path: Optional[str]) -> Optional[str]:
    """The shared token: the file's first line, or FOREBAY_TOKEN."""
    if path:
        with open(path, encoding="utf-8") as f:
            tok = f.readline().strip()
        if not tok:
            raise ModelRepositoryError(f"{path}: empty token file")
        return tok
    return os.environ.get("FOREBAY_TOKEN")

