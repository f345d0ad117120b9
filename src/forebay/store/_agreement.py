"""What the ranks of a store must agree on, checked in one collective: a check that fails
on one rank fails on every rank, naming each rank's value (no rank is left waiting in a
collective the others never enter)."""

from __future__ import annotations

from typing import Any, Optional

from ..comm import node_ranks
from ..dataset import Manifest, PackedDataset
from ..errors import RankMismatchError
from ._base import StoreError

__all__ = ["agree", "agree_on_prefix", "check_agreement", "prefixes", "raise_mismatches",
           "node_size"]


def agree(comm: Any, message: Optional[str], error: type[Exception] = StoreError) -> None:
    """Raise ``error`` on every rank if any rank has a message: a check that fails on
    one rank fails on all (no rank is left waiting in a collective)."""
    msgs = comm.allgather(message) if comm is not None else [message]
    bad = [(r, m) for r, m in enumerate(msgs) if m]
    if bad:
        text = "; ".join(f"rank {r}: {m}" if comm is not None else m for r, m in bad[:4])
        raise error(text + (f" (+{len(bad) - 4} more ranks)" if len(bad) > 4 else ""))


def _rank_list(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [-1]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def prefixes(ds: "PackedDataset | Manifest") -> list[tuple[int, str]]:
    """``(samples, fingerprint)`` of each generation of a dataset (or its manifest;
    issue U: a dataset that grows): the fingerprint of the shards holding its first
    samples, the same in every later generation (appends add shards and never change
    one)."""
    from ..dataset import generations, prefix_fingerprint

    m = ds.manifest if isinstance(ds, PackedDataset) else ds
    out, count = [], 0
    ends = set(generations(m))
    for k, s in enumerate(m.shards):
        count += s.num_samples
        if count in ends:
            out.append((count, prefix_fingerprint(m.shards[:k + 1])))
    return out


def agree_on_prefix(comm: Any, ds: "PackedDataset | Manifest", where: str = "") -> int:
    """The samples every rank of ``comm`` sees of a growing dataset (opened, or only its
    manifest read): the largest generation all of them saw (producers may append
    between two ranks' reads), checked to be the same samples everywhere (else
    :class:`StoreError` on every rank).  One allgather."""
    mine = prefixes(ds)
    every = comm.allgather(mine) if comm is not None else [mine]
    n = min(p[-1][0] for p in every)
    fps = {dict(p).get(n) for p in every}
    if len(fps) != 1 or None in fps:
        name = ds.path if isinstance(ds, PackedDataset) else where
        raise StoreError(f"ranks see different samples in {name}: their generations "
                         f"do not share the first {n} samples (a dataset replaced, not "
                         f"appended to?)")
    return n


def check_agreement(comm: Any, what: str, ds: PackedDataset, params: dict[str, Any],
                    dataset_id: Optional[tuple] = None) -> None:
    """Every rank of ``comm`` opened the same dataset (manifest fingerprint and size;
    else :class:`StoreError`) and passed the same ``params`` (everything that shapes the
    plan and the layout; else :class:`RankMismatchError`), raised on every rank naming
    each difference and each rank's value.  One allgather, the first collective of a
    set-up, so ranks that disagree fail before they wait in different collectives.
    ``dataset_id``: ``(identity, samples, path)`` compared instead of the dataset's
    fingerprint (a growing dataset's ranks compare its prefix later)."""
    if comm is None:
        return
    from .._version import __version__

    mine = {"forebay version": __version__, **params}
    every = comm.allgather((dataset_id or (ds.fingerprint, len(ds), str(ds.path)), mine))
    sets = [d for d, _ in every]
    if len({(fp, n) for fp, n, _ in sets}) > 1:
        ref = sets[0]
        diff = [f"rank {r} has {p} ({n} samples, fingerprint {fp})"
                for r, (fp, n, p) in enumerate(sets) if (fp, n) != ref[:2]]
        raise StoreError(f"ranks opened different datasets: rank 0 has {ref[2]} "
                         f"({ref[1]} samples, fingerprint {ref[0]}); " + "; ".join(diff[:4]))
    raise_mismatches(what, [p for _, p in every])


def raise_mismatches(what: str, every: "list[dict[str, Any]]") -> None:
    """Raise :class:`RankMismatchError` naming each key of the ranks' dicts ``every``
    (one per rank, in rank order) whose values differ, and each rank's value."""
    diffs = []
    keys = list(dict.fromkeys(k for p in every for k in p))
    for key in keys:
        values = [p.get(key) for p in every]
        if len({repr(v) for v in values}) > 1:
            by_value: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(repr(v), []).append(r)
            diffs.append(f"{key} " + ", ".join(
                f"{v} on rank{'s' if len(rs) > 1 else ''} {_rank_list(rs)}"
                for v, rs in list(by_value.items())[:4]))
    if diffs:
        raise RankMismatchError(f"ranks disagree on the {what}: " + "; ".join(diffs) +
                                " (every rank must pass the same values)")


def node_size(comm: Any) -> int:
    """Ranks of ``comm`` on this rank's node (1 without a communicator)."""
    return len(node_ranks(comm))
