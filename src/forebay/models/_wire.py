"""The model providers' wire protocol, shared by ``forebay models serve`` and the
``tcp://`` client.

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

import os
import socket
import struct
from typing import Any, Optional, Sequence

from ..errors import ConnectionClosedError, ModelRepositoryError

__all__ = ["HEADER", "OP", "ProtocolError", "parse_addresses", "token_from_file"]


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


#: arrays and maps in one frame's metadata, in all: the per-container limits above
#: leave 64 MiB of one-byte empty arrays free to become 4.4 GiB of Python lists
MAX_CONTAINERS = 1 << 20


class _TooMany(Exception):
    pass


def _unpackb(raw: bytes) -> Any:
    import msgpack

    left = [MAX_CONTAINERS]

    def count(obj: Any) -> Any:      # called as each array or map is built: stop early
        left[0] -= 1
        if left[0] < 0:
            raise _TooMany
        return obj

    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, list_hook=count,
                               object_hook=count, **_UNPACK_LIMITS)
    except _TooMany:
        raise ProtocolError(f"frame metadata holds more than {MAX_CONTAINERS} arrays and "
                            f"maps") from None
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
        if not 0 <= int(port) <= 65535:
            raise ModelRepositoryError(f"{url}: port {port} is not a TCP port (0-65535)")
        out.append((host, int(port)))
    return out


# -- the provider -----------------------------------------------------------------------------


def token_from_file(path: Optional[str]) -> Optional[str]:
    """The shared token: the file's first line, or FOREBAY_TOKEN."""
    if path:
        with open(path, encoding="utf-8") as f:
            tok = f.readline().strip()
        if not tok:
            raise ModelRepositoryError(f"{path}: empty token file")
        return tok
    return os.environ.get("FOREBAY_TOKEN")
