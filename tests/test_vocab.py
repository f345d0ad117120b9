"""One encoding per concept: the stores, the simulator and tracing share forebay.vocab."""

from __future__ import annotations

from forebay import sim, store, trace
from forebay.vocab import Backoff, FetchPath, FillState, Source, Tier


def test_tiers_sources_and_paths_are_spelled_once():
    assert (store.RAM, store.SSD, store.NONE) == (Tier.RAM, Tier.SSD, Tier.NONE) == (0, 1, -1)
    assert trace.SOURCES == tuple(s.value for s in Source) == ("local", "peer", "pfs")
    assert sim.SOURCES == tuple(p.label for p in FetchPath)
    assert sim.SOURCES[FetchPath.RAM] == "ram" and sim.SOURCES[FetchPath.PEER_SSD] == "peer_ssd"
    assert [int(s) for s in FillState] == [0, 1, 2]


def test_backoff_doubles_up_to_its_cap():
    b = Backoff(first=0.0001, cap=0.0004)
    delays = []
    for _ in range(4):
        delays.append(b.delay)
        b.sleep()
    assert delays == [0.0001, 0.0002, 0.0004, 0.0004]
