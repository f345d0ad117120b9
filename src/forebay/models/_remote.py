"""The ``tcp://`` client of model providers: a repository whose operations are frames
(see :mod:`._wire`) to one or more providers, each model on one of them."""

from __future__ import annotations

import builtins
import socket
import threading
from typing import Any, Optional, Sequence

import numpy as np
import xxhash

from ..errors import CorruptModelError, ModelNotFoundError, ModelRepositoryError
from ._store import PENDING_GRACE_S, ModelStore
from ._tensors import _copy_into, tensor_hash
from ._wire import (OP, VERSION, ProtocolError, _recv_exact, _recv_header, _recv_into, _send,
                    _unpackb, parse_addresses)

__all__ = ["RemoteRepository"]


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
