"""A producer's node-local dataset served to consumers on other nodes, and the
consumer's mirror of it (issue U, item 3: DYAD's path).

A producer appends generations (:func:`~forebay.dataset.append`) to a dataset on its
node's own storage and serves it (:func:`serve_dataset`, ``forebay serve``); a
consumer on another node waits for the samples it needs and copies the new
generations' files from the producer's node into a dataset on its own node
(:func:`mirror`, ``forebay mirror``), which it then reads like any dataset (a loader
with ``follow_appends=True`` over the mirror).  The shared file system is not on the
path; when the producer's node does not answer, a consumer given ``fallback=`` reads
the shared copy instead.

The protocol is HTTP/1.1 (the standard library's server and client), GET only:
``/manifest``; ``/wait?samples=N&timeout=S`` (the manifest once the dataset holds N
samples, or 504); ``/file/NAME`` (a shard or index file the current manifest names;
shard files never change once published).  Every request carries the shared token
(``Authorization: Bearer``, compared in constant time); the server binds 127.0.0.1
unless told otherwise, reads no request body, serves only the files its manifest
names, and bounds the connections it serves at once.  The consumer checks the
manifest's checksum, each file's size and xxh3 against it, and that the producer's
dataset continues the mirror's (a replaced dataset is refused); a generation appears
in the mirror whole (its files renamed in, then the manifest), or not at all.
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional
from urllib.parse import parse_qs, quote, urlsplit

import xxhash

from .._fs import Flock, fsync_dir
from ..errors import (ChecksumError, DatasetServerError, InvalidArgumentError,
                      WaitTimeoutError)
from ._append import wait_for
from ._format import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ShardInfo
from ._reader import PackedDataset, open_dataset

__all__ = ["DatasetServer", "mirror", "serve_dataset", "TOKEN_ENV"]

log = logging.getLogger("forebay.dataset.serve")

#: the shared token when none is given
TOKEN_ENV = "FOREBAY_TOKEN"
#: the longest a /wait request may ask to wait (s)
MAX_WAIT_S = 600.0
#: how often the server looks at its manifest while a consumer waits (local: cheap)
_POLL_S = 0.005
_CHUNK = 1 << 20


def _token(token: Optional[str]) -> str:
    return token if token is not None else os.environ.get(TOKEN_ENV, "")


class DatasetServer(ThreadingHTTPServer):
    """Serves the dataset at ``path`` to :func:`mirror` (``forebay serve``): started by
    :func:`serve_dataset`; :attr:`url` is where, :meth:`close` stops it.  ``workers``
    bounds the file transfers served at once (a waiting consumer holds none)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, path: "str | os.PathLike[str]", listen: "tuple[str, int]",
                 token: Optional[str], *, workers: int = 16,
                 allow_no_token: bool = False) -> None:
        self.path = Path(path)
        self.token = _token(token)
        if not self.token and not allow_no_token:
            raise InvalidArgumentError(f"serving {self.path} needs a shared token (token=, "
                                       f"or {TOKEN_ENV}); allow_no_token=True serves anyone")
        Manifest.read(self.path)                       # a dataset, and an intact one
        self.slots = threading.BoundedSemaphore(workers)
        self.bytes_sent = 0
        self.files_sent = 0
        #: (the manifest file's identity, what _Handler._manifest read from it)
        self.manifest_seen: Any = None
        self._thread: Optional[threading.Thread] = None
        super().__init__(listen, _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a consumer that went away mid-reply (it timed out, or its node is gone): the
        # server goes on serving the others
        log.debug("%s: request ended early", client_address, exc_info=True)

    def start(self) -> "DatasetServer":
        self._thread = threading.Thread(target=self.serve_forever, name="forebay-serve",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "DatasetServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_dataset(path: "str | os.PathLike[str]", listen: str = "127.0.0.1:0", *,
                  token: Optional[str] = None, workers: int = 16,
                  allow_no_token: bool = False) -> DatasetServer:
    """Serve the dataset at ``path`` (a producer's node-local dataset) to consumers'
    :func:`mirror` on ``listen`` (``HOST:PORT``; port 0: any free one), in a thread;
    returns the running :class:`DatasetServer` (its ``url``).  ``token``: the shared
    token every request must carry (default ``FOREBAY_TOKEN``)."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgumentError(f"listen must be HOST:PORT, got {listen!r}")
    return DatasetServer(path, (host, int(port)), token, workers=workers,
                         allow_no_token=allow_no_token).start()


class _Handler(BaseHTTPRequestHandler):
    server: DatasetServer
    protocol_version = "HTTP/1.1"
    timeout = 30                      # an idle connection is closed
    server_version = "forebay"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        # replies are a header then a body: without NODELAY each waits for an ACK
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _reply(self, code: int, body: bytes = b"", kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, message: str, **extra: Any) -> None:
        self._reply(code, json.dumps({"error": message, **extra}).encode())

    def do_GET(self) -> None:  # noqa: N802 - the standard library's name
        want = f"Bearer {self.server.token}".encode()
        got = (self.headers.get("Authorization") or "").encode("utf-8", "replace")
        if self.server.token and not hmac.compare_digest(got, want):
            self._error(401, "a wrong or missing token")
            return
        try:
            self._get(urlsplit(self.path))
        except (OSError, ValueError, KeyError, TypeError) as e:   # its dataset went bad
            log.warning("%s: %s", self.server.path, e)
            self._error(500, f"the served dataset cannot be read: {type(e).__name__}")

    def _get(self, url: Any) -> None:
        if url.path == "/manifest":
            self._reply(200, self._manifest()[0])
        elif url.path == "/wait":           # a waiting consumer holds no slot
            self._wait(parse_qs(url.query))
        elif url.path.startswith("/file/"):
            if not self.server.slots.acquire(timeout=30):
                self._error(503, "the server is busy: try again")
                return
            try:
                self._file(url.path[len("/file/"):])
            finally:
                self.server.slots.release()
        else:
            self._error(404, f"no such resource {url.path[:100]!r}")

    def _manifest(self) -> "tuple[bytes, int, set[str]]":
        """The manifest's bytes as they are now, its sample count and the files it
        names (the only ones served): parsed again only when the file changed."""
        st = (self.server.path / MANIFEST_NAME).stat()
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        seen = self.server.manifest_seen
        if seen is not None and seen[0] == key:
            return seen[1]
        raw = (self.server.path / MANIFEST_NAME).read_bytes()
        doc = json.loads(raw)
        names = set()
        for s in doc["shards"]:
            info = ShardInfo.from_dict(s)
            names |= {info.data, info.index}
        got = (raw, int(doc["num_samples"]), names)
        self.server.manifest_seen = (key, got)
        return got

    def _wait(self, query: dict) -> None:
        try:
            samples = int(query.get("samples", ["0"])[0])
            timeout = float(query.get("timeout", ["0"])[0])
            if samples < 0 or not 0 <= timeout <= MAX_WAIT_S:
                raise ValueError
        except ValueError:
            self._error(400, f"wait takes samples >= 0 and a timeout of 0 to "
                             f"{MAX_WAIT_S:g} s")
            return
        deadline = time.monotonic() + timeout
        while True:
            raw, have, _ = self._manifest()      # (parsed again only when it changed)
            if have >= samples:
                self._reply(200, raw)
                return
            if time.monotonic() >= deadline:
                self._error(504, f"{have} samples, waiting for {samples}", have=have)
                return
            time.sleep(_POLL_S)

    def _file(self, name: str) -> None:
        if name not in self._manifest()[2]:
            self._error(404, f"{name[:100]!r} is not a file of the dataset's manifest")
            return
        with open(self.server.path / name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.wfile.flush()
            self.connection.sendfile(f)
        self.server.bytes_sent += size
        self.server.files_sent += 1


# -- the consumer -----------------------------------------------------------------------


class _Connection(http.client.HTTPConnection):
    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Client:
    """One keep-alive connection to a :class:`DatasetServer`."""

    def __init__(self, url: str, token: str, timeout: float) -> None:
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname or u.port is None:
            raise InvalidArgumentError(f"a dataset server's url is http://HOST:PORT, got "
                                       f"{url!r}")
        self.url, self.token = url, token
        self.conn = _Connection(u.hostname, u.port, timeout=timeout)

    def get(self, path: str) -> http.client.HTTPResponse:
        try:
            self.conn.request("GET", path, headers={"Authorization": f"Bearer {self.token}"})
            r = self.conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            self.conn.close()
            raise DatasetServerError(f"the dataset server at {self.url} does not answer: "
                                     f"{e}") from e
        if r.status != 200:
            body = r.read(64 << 10)
            try:
                doc = json.loads(body)
            except ValueError:
                doc = {}
            if r.status == 504:
                raise WaitTimeoutError(f"{self.url}: {doc.get('error', 'timed out')}")
            raise DatasetServerError(f"the dataset server at {self.url} answered "
                                     f"{r.status}: {doc.get('error', r.reason)}")
        return r

    def close(self) -> None:
        self.conn.close()


def mirror(url: str, into: "str | os.PathLike[str]", *, samples: Optional[int] = None,
           timeout: Optional[float] = None, token: Optional[str] = None,
           fallback: "str | os.PathLike[str] | None" = None) -> PackedDataset:
    """The dataset a producer serves at ``url`` (:func:`serve_dataset`), copied to the
    directory ``into`` (this node's storage) up to its latest generation, and opened;
    with ``samples``, first waits until the producer holds that many (``timeout``
    seconds; :class:`~forebay.errors.WaitTimeoutError` after, nothing changed).

    Only the generations the mirror lacks are copied; each file is checked (size and
    xxh3 against the manifest) before the generation appears, whole; the producer's
    dataset must continue the mirror's.  Several consumers of one node may mirror into
    the same directory (an ``flock`` orders them).  ``fallback``: the dataset's copy on
    the shared file system, read when the producer does not answer (its node is gone,
    or it stopped serving): then :func:`wait_for` there and that dataset is returned.
    """
    from ._append import _traced

    t0 = time.perf_counter()
    client = _Client(url, _token(token), timeout=MAX_WAIT_S + 30.0)
    try:
        try:
            raw = _wait(client, samples, timeout)
        except DatasetServerError:
            if fallback is None:
                raise
            log.warning("%s does not answer: reading %s", url, fallback)
            wait_for(fallback, samples or 0, timeout=timeout)
            return open_dataset(fallback)
        into = Path(into)
        into.mkdir(parents=True, exist_ok=True)
        with Flock(into / ".mirror.lock"):
            got = _copy_generations(client, raw, into)
    finally:
        client.close()
    _traced("consumer", "mirror", t0, got, -1)
    return open_dataset(into)


def _wait(client: _Client, samples: Optional[int], timeout: Optional[float]) -> bytes:
    """The producer's manifest, once it holds ``samples`` (None: as it is now); waits of
    at most :data:`MAX_WAIT_S` each, asked again until ``timeout`` (None: no limit)."""
    if samples is None:
        return _body(client.get("/manifest"), MAX_MANIFEST_BYTES)
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    while True:
        left = MAX_WAIT_S if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return _body(client.get(f"/wait?samples={int(samples)}&timeout="
                                    f"{min(left, MAX_WAIT_S):.3f}"), MAX_MANIFEST_BYTES)
        except WaitTimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise


def _body(r: http.client.HTTPResponse, limit: int) -> bytes:
    size = int(r.getheader("Content-Length") or -1)
    if not 0 <= size <= limit:
        r.close()
        raise DatasetServerError(f"a reply of {size} bytes (at most {limit} expected)")
    return r.read(size)


def _copy_generations(client: _Client, raw: bytes, into: Path) -> int:
    """The shards of manifest ``raw`` that ``into`` lacks, fetched, checked and renamed
    in, then the manifest; returns the samples added."""
    for old in into.glob(".mirror-*"):                 # a killed mirror's (under the lock)
        shutil.rmtree(old, ignore_errors=True)
    stage = into / f".mirror-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    try:
        (stage / MANIFEST_NAME).write_bytes(raw)
        new = Manifest.read(stage)                     # its checksum, shapes and names
        cur = Manifest.read(into) if (into / MANIFEST_NAME).exists() else None
        have = cur.shards if cur is not None else ()
        if new.shards[:len(have)] != have or (cur is not None and new.schema != cur.schema):
            raise DatasetServerError(f"{client.url} serves a dataset that does not continue "
                                     f"the mirror at {into} (replaced, not appended to?)")
        fresh = new.shards[len(have):]
        for s in fresh:
            for name, size, digest in ((s.data, s.data_nbytes, s.data_checksum),
                                       (s.index, s.index_nbytes, s.index_checksum)):
                _fetch(client, name, size, digest, stage / name)
        for s in fresh:
            for name in (s.data, s.index):
                os.replace(stage / name, into / name)
        fsync_dir(into)
        os.replace(stage / MANIFEST_NAME, into / MANIFEST_NAME)   # the generations appear
        fsync_dir(into)
        return new.num_samples - (cur.num_samples if cur is not None else 0)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _fetch(client: _Client, name: str, size: int, digest: str, dst: Path) -> None:
    r = client.get(f"/file/{quote(name)}")
    if int(r.getheader("Content-Length") or -1) != size:
        r.close()
        raise ChecksumError(f"{client.url}: {name} is {r.getheader('Content-Length')} bytes, "
                            f"its manifest says {size}")
    h = xxhash.xxh3_64()
    left = size
    with open(dst, "wb") as f:
        while left:
            chunk = r.read(min(left, _CHUNK))
            if not chunk:
                raise DatasetServerError(f"{client.url}: {name} ended after "
                                         f"{size - left} of {size} bytes")
            h.update(chunk)
            f.write(chunk)
            left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())
    if h.hexdigest() != digest:
        raise ChecksumError(f"{client.url}: {name} as received fails its checksum (damaged "
                            f"on the producer's node or on the way)")
