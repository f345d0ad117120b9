"""The data plane's deadline (forebay._liveness): what a probe of a peer sees, and the
deadline's setting.  The deadline ending a job whose peer is gone is tested across
emulated nodes (tests/test_cluster.py: a cut link, a killed node, a slow link)."""

from __future__ import annotations

import socket
import threading

import pytest

from forebay import _liveness
from forebay.errors import InvalidArgumentError


def _listener(answer: bytes) -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)

    def serve() -> None:
        try:
            conn, _ = s.accept()
        except OSError:
            return
        conn.sendall(answer)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return s, s.getsockname()[1]


def test_a_probe_tells_a_live_rank_a_gone_process_and_a_stranger():
    s, port = _listener(b"FBLV" + (3).to_bytes(4, "little", signed=True))
    with s:
        assert _liveness._probe("127.0.0.1", port, 3) is None
    s, port = _listener(b"HTTP/1.1 200 OK\r\n")
    with s:
        assert "something else answers" in _liveness._probe("127.0.0.1", port, 3)
    s, port = _listener(b"FBLV" + (4).to_bytes(4, "little", signed=True))
    with s:                                           # another rank's listener
        assert "something else answers" in _liveness._probe("127.0.0.1", port, 3)
    s, port = _listener(b"")                          # a listener ending: not a word
    with s:
        assert "the rank does not: its process is gone" in \
            _liveness._probe("127.0.0.1", port, 3)
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()                                      # nothing listens there now
    assert "its process is gone" in _liveness._probe("127.0.0.1", port, 3)


def test_the_deadline_setting(monkeypatch):
    monkeypatch.delenv(_liveness.TIMEOUT_ENV, raising=False)
    assert _liveness.peer_timeout() == _liveness.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(_liveness.TIMEOUT_ENV, "0")
    assert _liveness.peer_timeout() == 0
    monkeypatch.setenv(_liveness.TIMEOUT_ENV, "2.5")
    assert _liveness.peer_timeout() == 2.5
    for bad in ("-1", "soon", "nan", "inf"):
        monkeypatch.setenv(_liveness.TIMEOUT_ENV, bad)
        with pytest.raises(InvalidArgumentError, match="FOREBAY_PEER_TIMEOUT"):
            _liveness.peer_timeout()


def test_a_wait_outside_a_job_of_several_ranks_costs_nothing():
    assert not _liveness._W.table
    with _liveness.waiting("a test"):
        assert not _liveness._W.waits
