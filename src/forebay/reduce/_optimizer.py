"""Horovod's user-facing names on torch.distributed: DistributedOptimizer,
broadcast_parameters, allreduce_async."""
from __future__ import annotations

import contextlib
from collections import Counter
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .. import trace
from ..errors import ArgumentTypeError, InvalidArgumentError, ReduceError
from ._cache import Params
from ._coordinator import Coordinator, Handle


class _DistributedOptimizer:
    """Mixed into a dynamic subclass of the wrapped optimizer's class (as Horovod does), so
    ``isinstance(opt, torch.optim.SGD)`` and LR schedulers keep working."""

    def _fb_setup(self, named_parameters, *, process_group, groups, cycle_time_ms,
                  fusion_threshold_bytes, coordination, cache_capacity, backward_passes_per_step,
                  op, timeout_s):
        named = _named_parameters(self, named_parameters)
        self._fb_names = {p: n for n, p in named}
        self._fb_params = [p for _, p in named if p.requires_grad]
        self._fb_passes = int(backward_passes_per_step)
        if self._fb_passes < 1:
            raise InvalidArgumentError("backward_passes_per_step must be at least 1")
        self._fb_op = op
        self._fb_timeout = float(timeout_s)
        if op == "average" and any(not p.is_floating_point() for p in self._fb_params):
            raise ArgumentTypeError("op 'average' needs floating point parameters")
        group_of = _group_ids(groups, named)
        self._fb_coord = Coordinator(process_group=process_group, coordination=coordination,
                                     cycle_time_ms=cycle_time_ms,
                                     fusion_threshold_bytes=fusion_threshold_bytes,
                                     cache_capacity=cache_capacity, timeout_s=timeout_s,
                                     start=False)
        try:
            _check_same_everywhere(self._fb_coord, named)
        except BaseException:
            self._fb_coord.close()     # nothing of a refused optimizer outlives it
            raise
        members: dict[int, list[str]] = {}
        for n, p in named:
            if p.requires_grad and group_of.get(p, -1) >= 0:
                members.setdefault(group_of[p], []).append(n)
        for g, names in members.items():
            self._fb_coord.register_group(g, names)
        self._fb_req = {p: Params(tuple(p.shape), str(p.dtype).replace("torch.", ""), op,
                                  group_of.get(p, -1)) for p in self._fb_params}
        # canonical named_parameters order gives the cache positions on every rank
        self._fb_coord.preload((self._fb_names[p], self._fb_req[p]) for p in self._fb_params)
        self._fb_handles: dict[torch.Tensor, Handle] = {}
        self._fb_counts = {p: 0 for p in self._fb_params}
        self._fb_skip = False
        self._fb_step_marks = self._fb_coord.snapshot()[0]
        self._fb_last_step: dict = {}
        self._fb_steps = 0
        self._fb_hooks = [p.register_post_accumulate_grad_hook(self._fb_hook)
                          for p in self._fb_params]
        self._fb_finalizer = weakref.finalize(self, self._fb_coord.close)
        self._fb_coord.start()

    # -- readiness ------------------------------------------------------------------------

    def _fb_hook(self, p: torch.Tensor) -> None:
        if p in self._fb_handles:
            raise ReduceError(
                f"the gradient of {self._fb_names[p]!r} was computed more than "
                f"backward_passes_per_step={self._fb_passes} times before step() or "
                "synchronize(); raise backward_passes_per_step to accumulate more passes")
        self._fb_counts[p] += 1
        if self._fb_counts[p] == self._fb_passes:
            self._fb_submit(p)

    def _fb_submit(self, p: torch.Tensor) -> None:
        if p.grad is None:            # no gradient on this rank this step: it contributes zeros
            p.grad = torch.zeros_like(p)
        self._fb_handles[p] = self._fb_coord.submit(self._fb_names[p], p.grad, self._fb_op,
                                                    inplace=True, params=self._fb_req[p])

    # -- public ---------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait until every gradient is reduced. Parameters that got no gradient this step
        (on this rank) are submitted now with zeros, so every rank reduces every parameter
        once per step and a conditionally unused parameter never deadlocks."""
        for p in self._fb_params:
            if p not in self._fb_handles:
                self._fb_submit(p)
        try:
            with trace.region("comm/synchronize"):   # the communication left exposed
                for h in self._fb_handles.values():
                    h.wait(self._fb_timeout)
        finally:
            self._fb_handles.clear()
            for p in self._fb_counts:
                self._fb_counts[p] = 0
        self._fb_mark_step()

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``opt.synchronize(); clip(...); with opt.skip_synchronize(): opt.step()``."""
        self._fb_skip = True
        try:
            yield
        finally:
            self._fb_skip = False

    def step(self, closure=None):
        if not self._fb_skip:
            self.synchronize()
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._fb_handles:
            raise ReduceError("optimizer.zero_grad() was called after loss.backward() but "
                              "before optimizer.step() or optimizer.synchronize()")
        return super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]

    def close(self) -> None:
        """Stop the coordinator (on every rank: call it on all of them at the end)."""
        for h in self._fb_hooks:
            h.remove()
        self._fb_hooks = []
        self._fb_coord.close()

    def stats(self) -> dict:
        """Coordination and communication counters: totals, per-step means, the last step."""
        c = self._fb_coord
        totals, _ = c.snapshot()
        steps = max(self._fb_steps, 1)
        return {
            "coordination": c.coordination, "world": c.world, "rank": c.rank,
            "steps": self._fb_steps, "totals": totals,
            "per_step": {k: v / steps for k, v in totals.items()},
            "last_step": dict(self._fb_last_step),
            "cache": {"capacity": c.cache.capacity, "entries": len(c.cache),
                      "evictions": c.cache.evictions, "invalidations": c.cache.invalidations},
        }

    def _fb_mark_step(self) -> None:
        now, sizes = self._fb_coord.snapshot(clear_sizes=True)
        last = {k: now[k] - self._fb_step_marks.get(k, 0) for k in now}
        last["fused_sizes"] = sizes
        self._fb_last_step, self._fb_step_marks = last, now
        self._fb_steps += 1


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, *,
                         process_group=None, groups=None, cycle_time_ms: float = 1.0,
                         fusion_threshold_bytes: int = 64 << 20,
                         coordination: str = "bitvector", cache_capacity: int = 1024,
                         backward_passes_per_step: int = 1, op: str = "average",
                         timeout_s: float = 300.0):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Gradients are submitted as they become ready during ``backward()`` (post-accumulate-grad
    hooks) and reduced by a background coordinator while backward still runs.
    ``named_parameters``: the model's ``named_parameters()`` (same names, same order on every
    rank; checked at construction). ``groups``: an int (that many groups in parameter order)
    or a list of lists of parameters; a group is reduced in one fused buffer once all its
    gradients are ready on every rank. ``coordination``: ``"bitvector"`` (cached, one BAND
    all-reduce per cycle) or ``"master"`` (rank 0 gathers requests every cycle).
    Construction is collective over the default process group.
    """
    cls: Any = type(optimizer.__class__.__name__,
                    (_DistributedOptimizer, optimizer.__class__), {})
    opt = cls.__new__(cls)
    opt.__dict__.update(optimizer.__dict__)        # shares param_groups, state, hooks
    opt._fb_setup(named_parameters, process_group=process_group, groups=groups,
                  cycle_time_ms=cycle_time_ms, fusion_threshold_bytes=fusion_threshold_bytes,
                  coordination=coordination, cache_capacity=cache_capacity,
                  backward_passes_per_step=backward_passes_per_step, op=op, timeout_s=timeout_s)
    return opt


def _named_parameters(opt, named_parameters) -> list[tuple[str, torch.Tensor]]:
    params = [p for g in opt.param_groups for p in g["params"]]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    names = [n for n, _ in named]
    dup = sorted(n for n, k in Counter(names).items() if k > 1)
    if dup:
        raise InvalidArgumentError(f"named_parameters has duplicate names: {dup[:5]}")
    known = {id(p) for _, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in known]
    if missing:
        raise InvalidArgumentError(f"{len(missing)} of the optimizer's parameters are not in "
                         "named_parameters (pass model.named_parameters() of the model whose "
                         "parameters the optimizer updates)")
    mine = {id(p) for p in params}
    return [(n, p) for n, p in named if id(p) in mine]


def _group_ids(groups, named) -> dict:
    if groups is None:
        return {}
    trainable = [p for _, p in named if p.requires_grad]
    if isinstance(groups, int):
        if groups < 1:
            raise InvalidArgumentError(
                f"groups must be a positive int or a list of lists, got {groups}")
        k = min(groups, len(trainable)) or 1
        size = -(-len(trainable) // k)
        return {p: i // size for i, p in enumerate(trainable)}
    out = {}
    for g, members in enumerate(groups):
        for p in members:
            if p in out:
                raise InvalidArgumentError("a parameter appears in two groups")
            out[p] = g
    unknown = [p for p in out if not any(p is q for q in trainable)]
    if unknown:
        raise InvalidArgumentError(
            f"{len(unknown)} grouped tensors are not trainable parameters of "
            "this optimizer")
    return out


def _check_same_everywhere(coord: Coordinator, named) -> None:
    """Every rank must register the same parameter names, shapes and dtypes in one order."""
    import xxhash
    h = xxhash.xxh64()
    for n, p in named:
        h.update(f"{n}|{tuple(p.shape)}|{p.dtype}|{p.requires_grad};".encode())
    digest = h.intdigest() & 0x7FFFFFFFFFFFFFFF
    t = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=coord.ctrl_group)
    if int(t[0]) != digest or -int(t[1]) != digest:
        raise ReduceError("ranks passed different parameter lists to DistributedOptimizer "
                          "(names, shapes, dtypes or order differ): build the same model on "
                          "every rank and pass model.named_parameters()")


# ---------------------------------------------------------------------------------------
# module-level API on a default coordinator

_default: Coordinator | None = None
_default_lock = threading.Lock()


def _coordinator() -> Coordinator:
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Coordinator()
        return _default


def allreduce_async(tensor: torch.Tensor, name: str, op: str = "average") -> Handle:
    """Reduce ``tensor`` over all ranks in the background; ``handle.wait()`` returns the result
    (a new tensor; the input is not modified). Every rank must submit ``name`` with the same
    shape and dtype, in any order. The first call creates the default coordinator, which is
    collective: make it on every rank."""
    return _coordinator().submit(name, tensor, op)


def allreduce(tensor: torch.Tensor, name: str, op: str = "average") -> torch.Tensor:
    return allreduce_async(tensor, name, op).wait()


def shutdown() -> None:
    """Stop the default coordinator of ``allreduce_async`` (on every rank)."""
    global _default
    with _default_lock:
        if _default is not None:
            _default.close()
            _default = None


@torch.no_grad()
def broadcast_parameters(params, root_rank: int = 0, process_group=None) -> None:
    """Copy ``root_rank``'s tensors into every rank's, in place: a ``state_dict()``, a
    ``named_parameters()`` iterable, or a list of tensors. One broadcast per dtype and device
    (tensors are packed into a flat buffer)."""
    if isinstance(params, dict):
        items = list(params.items())
    else:
        items = [(i, p) if isinstance(p, torch.Tensor) else p for i, p in enumerate(params)]
    tensors = [t for _, t in items if isinstance(t, torch.Tensor)]
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for ts in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.broadcast(flat, src=root_rank, group=process_group)
        off = 0
        for t in ts:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()
