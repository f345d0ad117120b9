"""The background coordinator: one thread per coordinator, one coordination cycle per tic.

Collectives on a tensor must be issued in the same order on every rank, but ranks produce
gradients in their own order and at their own time. Each cycle the coordinator agrees with
the other ranks on which submitted tensors are ready *everywhere*, then every rank launches
the same fused all-reduces in the same order on the data group.

``coordination="bitvector"`` (Horovod's cached path, Kurth et al. 2019 §4.1): one int64
BAND all-reduce on a dedicated gloo control group intersects the ranks' ready bits of
cached tensors; tensors the cache does not know (first step, ad-hoc names, evicted or
invalidated entries) fall back to the master-worker exchange for that cycle only.

``coordination="master"``: the original scheme every cycle; rank 0 gathers every rank's
new requests, counts them, and broadcasts the ordered list of tensors reported by all.

Grouping (§4.2): a tensor of a group is launched only once every tensor of its group is
ready on every rank; complete groups (and ungrouped tensors, greedily) are fused into flat
buffers up to the fusion threshold.

Over 600 lines on purpose: a cycle's agreement (bitvector, master exchange), its
execution (select, fuse, launch, finish) and its failure handling share one thread's
state; requests, handles and fusion buffers are in ``_requests.py``, the response
cache in ``_cache.py``.
"""
from __future__ import annotations

import atexit
import json
import logging
import threading
from typing import Any
import time
import weakref
from collections import deque
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from .. import trace
from ..errors import ArgumentTypeError, InvalidArgumentError, ReduceError, ReduceMismatchError
from ._cache import (BUSY, HIT, INVALID, SHUTDOWN, STALE, UNCACHED, Params, ResponseCache,
                     bits_of, invert_request_bits, new_vector, set_bits, status_of)

from ._requests import Handle, MasterTable, Request, flatten, owned_bytes, unflatten, use_count
log = logging.getLogger("forebay.reduce")

OPS = {"average": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM,
       "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
COORDINATIONS = ("bitvector", "master")
_MAX_MESSAGE = 64 << 20          # a coordination message larger than this is malformed


_LIVE: "weakref.WeakSet[Coordinator]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop every coordinator before interpreter teardown (a coordinator thread still running
    Python code then would be killed while inside torch and abort the process), then
    destroy the default group if forebay made it."""
    for c in list(_LIVE):
        c.close()
    from ._launch import _destroy_at_exit

    _destroy_at_exit()
    import gc
    gc.collect()        # groups held in reference cycles are freed while Python runs


class Coordinator:
    """Agrees on ready tensors every cycle and runs their fused all-reduces.

    Construction is collective: every rank of the default group must create its
    coordinators in the same order (each makes a data group and a gloo control group).
    """

    def __init__(self, *, process_group=None, coordination: str = "bitvector",
                 cycle_time_ms: float = 1.0, fusion_threshold_bytes: int = 64 << 20,
                 cache_capacity: int = 1024, timeout_s: float = 300.0,
                 stall_warning_s: float = 60.0, start: bool = True):
        if not dist.is_available() or not dist.is_initialized():
            raise ReduceError("torch.distributed is not initialized: call "
                              "forebay.reduce.init_process_group() (or "
                              "torch.distributed.init_process_group) first")
        if coordination not in COORDINATIONS:
            raise InvalidArgumentError(
                f"coordination must be one of {COORDINATIONS}, got {coordination!r}")
        if cycle_time_ms < 0 or fusion_threshold_bytes < 0:
            raise InvalidArgumentError("cycle_time_ms and fusion_threshold_bytes must be >= 0")
        self.coordination = coordination
        self.cycle_s = cycle_time_ms / 1000.0
        self.fusion_threshold = int(fusion_threshold_bytes)
        self.timeout_s = float(timeout_s)
        self.stall_warning_s = stall_warning_s
        ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
        timeout = timedelta(seconds=timeout_s)
        # Our own communicators: collectives the application issues from its thread on the
        # default group can never interleave with the coordinator's.
        self._own_data_group = process_group is None
        self.data_group = (dist.new_group(ranks, timeout=timeout) if process_group is None
                           else process_group)
        # for a subgroup only its members make the control group (others may be making
        # their own subgroup's at the same moment)
        self.ctrl_group = dist.new_group(ranks, timeout=timeout, backend="gloo",
                                         use_local_synchronization=ranks is not None)
        self.world = dist.get_world_size(self.data_group)
        self.rank = dist.get_rank(self.data_group)
        self._root = dist.get_global_rank(self.ctrl_group, 0) if ranks else 0
        self._global = [dist.get_global_rank(self.ctrl_group, i) for i in range(self.world)] \
            if ranks else list(range(self.world))
        self.cache = ResponseCache(cache_capacity)
        self._master = MasterTable(self.world) if self.rank == 0 else None
        self._groups: dict[int, list[str]] = {}
        self._inbox: deque[Request] = deque()
        self._pending: dict[str, Request] = {}
        self._pool: list[Request] = []          # ready on every rank, held for their group
        self._closing = False
        self._error: BaseException | None = None
        self._dead = False
        self.counters = dict(cycles=0, control_collectives=0, control_bytes_sent=0,
                             control_bytes_received=0, control_messages=0, data_collectives=0,
                             data_bytes=0, negotiated=0, cached=0, uncached_cycles=0,
                             invalid_cycles=0)
        self.fused_sizes: list[int] = []
        # a cycle counts into these, committed whole at its end: snapshots never see half
        self._cyc = dict.fromkeys(self.counters, 0)
        self._cyc_sizes: list[int] = []
        self._stats_lock = threading.Lock()
        # (tensor, its reference count before gloo had it) for this and the last cycle
        self._held_now: list[tuple[torch.Tensor, int]] = []
        self._held_before: list[tuple[torch.Tensor, int]] = []
        self._cond = threading.Condition()
        self._idle_vec = new_vector(self.cache.words)
        self._mine = 0                 # bits of this rank's pending hits (a Python int bitset)
        self._hits: dict[int, Request] = {}
        self._unsent: list[Request] = []              # to negotiate at the next exchange
        self._stale: list[Request] = []
        self._not_ready: list[Request] = []           # GPU tensors whose kernels still run
        self._idle_streak = 0
        self._wake = threading.Event()
        self._vec_t = torch.zeros(self.cache.words, dtype=torch.int64)   # reused every cycle
        self._band_opts = dist.AllreduceOptions()
        self._band_opts.reduceOp = dist.ReduceOp.BAND  # type: ignore[assignment]
        self._thread = threading.Thread(target=self._run, name="forebay-reduce", daemon=True)
        _LIVE.add(self)
        if start:
            self._thread.start()

    def start(self) -> None:
        """Start the cycles (construct with ``start=False`` to run set-up collectives on the
        control group first: nothing else may use it once the thread runs)."""
        if not self._thread.is_alive() and not self._dead:
            self._thread.start()

    # ------------------------------------------------------------------ application side

    def register_group(self, group_id: int, names: list[str]) -> None:
        self._groups[group_id] = list(names)

    def preload(self, entries) -> None:
        """Give cache positions to known tensors in a canonical order (same on every rank)."""
        if self.coordination == "bitvector":
            for name, params in entries:
                self.cache.put(name, params)

    def submit(self, name: str, tensor: torch.Tensor, op: str = "average", *, group: int = -1,
               inplace: bool = False, params: Params | None = None) -> Handle:
        """Queue ``tensor`` for reduction; ``params`` (precomputed by callers that submit the
        same tensor every step) skips validating op and dtype again."""
        if params is None:
            if op not in OPS:
                raise InvalidArgumentError(f"op must be one of {sorted(OPS)}, got {op!r}")
            if op == "average" and not (tensor.is_floating_point() or tensor.is_complex()):
                raise ArgumentTypeError(f"op 'average' needs a floating point tensor; {name!r} is "
                                f"{tensor.dtype} (use op='sum')")
            params = Params(tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""), op,
                            group)
        if self._closing or self._dead:
            self._check_alive()
        handle = Handle(name, self._cond)
        event = None
        if tensor.is_cuda:                     # ready once the kernels producing it are done
            event = torch.cuda.Event()
            event.record()
        if tensor.requires_grad:
            tensor = tensor.detach()
        self._inbox.append(Request(name, tensor, params, handle, inplace, event))
        if self._idle_streak >= 3:
            self._wake.set()
        if self._dead:                 # stopped between the check and the append
            self._check_alive_or_fail()
        return handle

    def close(self, timeout: float | None = None) -> None:
        """Stop the coordinator on every rank (the first rank to close stops them all)."""
        self._closing = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(self.timeout_s + 5 if timeout is None else timeout)
        elif self._thread.ident is None:
            # never started (a DistributedOptimizer refused at construction): its groups
            # are released here, not left to interpreter teardown, where destroying a
            # gloo group aborts the process about once in 60 exits ("terminate called
            # without an active exception")
            self._dead = True
            self._release_groups()

    @property
    def closed(self) -> bool:
        return self._dead

    def _check_alive_or_fail(self) -> None:
        while self._inbox:
            self._inbox.popleft().handle._finish(error=ReduceError(
                "the reduction coordinator has been shut down"))
        self._check_alive()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise ReduceError(f"the reduction coordinator stopped: {self._error}") from self._error
        if self._dead or self._closing:
            raise ReduceError("the reduction coordinator has been shut down (on this rank or "
                              "another one); no further all-reduces can run")

    # ------------------------------------------------------------------ coordinator thread

    def _run(self) -> None:
        try:
            while self._cycle():
                pause = self._cycle_start + self._sleep_s() - time.monotonic()
                if pause > 0:
                    self._wake.wait(pause)     # a submission ends an idle pause early
                    self._wake.clear()
            self._dead = True
            self._fail_all(ReduceError("the reduction coordinator was shut down"))
        except BaseException as exc:                       # noqa: BLE001 - handed to waiters
            self._error = exc
            self._dead = True
            self._fail_all(ReduceError(f"the reduction coordinator failed on rank {self.rank}: "
                                       f"{type(exc).__name__}: {exc}"))
        finally:
            self._dead = True
            self._drain_held()
            self._release_groups()

    def _release_groups(self) -> None:
        """Destroy our communicators now rather than in interpreter teardown (where gloo's
        worker threads may be torn down mid-flight and abort the process)."""
        groups = (self.ctrl_group, self.data_group if self._own_data_group else None)
        if self._own_data_group:
            self.data_group = None
        self.ctrl_group = None       # no reference keeps a destroyed group alive until exit
        for g in groups:
            if g is not None:
                try:
                    dist.destroy_process_group(g)
                except Exception:                 # noqa: BLE001 - already gone with the world
                    pass

    def _sleep_s(self) -> float:
        """The cycle time; after 3 cycles in which no rank had anything in flight (the same
        cycles on every rank), doubling up to 4x, so idle phases (forward pass, data
        loading) cost fewer control collectives. A submission on this rank ends the pause
        at once. (Up to 32x was tried: slower, since a rank whose backward starts a little
        later keeps the others waiting in the all-reduce for its long pause.)"""
        k = self._idle_streak
        return self.cycle_s if k < 3 else self.cycle_s * min(2 ** (k - 2), 4)

    def _fail_all(self, error: BaseException) -> None:
        while self._inbox:
            self._inbox.popleft().handle._finish(error=error)
        for r in list(self._pending.values()):
            r.handle._finish(error=error)
        self._pending.clear()
        self._pool.clear()
        self._hits.clear()
        self._mine = 0
        self._unsent, self._stale, self._not_ready = [], [], []

    def _cycle(self) -> bool:
        self._cycle_start = time.monotonic()
        self._held_before, self._held_now = self._held_now, []
        self._cyc["cycles"] = 1
        while self._inbox:
            r = self._inbox.popleft()
            if r.name in self._pending:
                r.handle._finish(error=ReduceError(
                    f"tensor {r.name!r} was submitted again before its previous all-reduce "
                    "completed (names must be unique among in-flight reductions)"))
                continue
            self._pending[r.name] = r
            if r.event is None or r.event.query():
                self._classify(r)
            else:
                self._not_ready.append(r)
        if self._not_ready:
            later: list[Any] = []
            for r in self._not_ready:
                (self._classify if r.event.query() else later.append)(r)
            self._not_ready = later
        if self.coordination == "master":
            unsent, self._unsent = self._unsent, []
            ready, shutdown = self._exchange(unsent, shutdown=self._closing,
                                             busy=bool(self._pending))
        else:
            ready, shutdown = self._bitvector_cycle()
        if shutdown:
            return False
        self._warn_stalls()
        self._execute(ready)
        self._commit()
        return True

    def _classify(self, r: Request) -> None:
        """Once per request (and again if its cache entry goes): a hit keeps its bit set in
        this rank's vector until it runs, so a cycle costs O(vector), not O(pending)."""
        if self.coordination == "master":
            self._unsent.append(r)
            return
        kind, r.bit = self.cache.lookup(r.name, r.params)
        if kind == HIT:
            self._hits[r.bit] = r
            self._mine |= 1 << r.bit
        elif kind == STALE:
            self._stale.append(r)
        else:
            self._unsent.append(r)

    def _uncache(self, bits) -> None:
        """Entries at ``bits`` are gone (erased or evicted): their pending hits must be
        negotiated again."""
        for b in bits:
            r = self._hits.pop(b, None)
            if r is not None:
                self._mine &= ~(1 << b)
                r.bit = -1
                self._unsent.append(r)

    # -- bitvector ---------------------------------------------------------------------

    def _bitvector_cycle(self):
        if not self._pending and not self._closing:     # idle here: only listen to the others
            vec = self._band(self._idle_vec)
            if status_of(vec) == 0:
                self._idle_streak += 1
                return [], False
            return self._bitvector_result(vec)
        status = (SHUTDOWN if self._closing else 0) | (UNCACHED if self._unsent else 0) \
            | (INVALID if self._stale else 0) | (BUSY if self._pending else 0)
        vec = new_vector(self.cache.words, status)
        vec[1:] = np.frombuffer(self._mine.to_bytes(8 * (len(vec) - 1), "little"), dtype="<i8")
        return self._bitvector_result(self._band(vec))

    def _bitvector_result(self, vec):
        cache = self.cache
        status = status_of(vec)
        if status & SHUTDOWN:
            return [], True
        self._idle_streak = 0 if status & BUSY else self._idle_streak + 1
        common = bits_of(vec).tolist()
        if status & INVALID:                # erase everywhere what any rank found stale
            self._cyc["invalid_cycles"] += 1
            inv = new_vector(cache.words)
            set_bits(inv, [r.bit for r in self._stale])
            gone = bits_of(invert_request_bits(self._band(invert_request_bits(inv)))).tolist()
            cache.erase(gone)
            self._uncache(gone)
            for r in self._stale:
                r.bit = -1
            self._unsent += self._stale
            self._stale = []
            gone = set(gone)
            common = [b for b in common if b not in gone]
        ready = [self._hits.pop(b) for b in common]
        for b in common:
            self._mine &= ~(1 << b)
        self._cyc["cached"] += len(ready)
        if status & (UNCACHED | INVALID):
            self._cyc["uncached_cycles"] += 1
            unsent, self._unsent = self._unsent, []
            negotiated, _ = self._exchange(unsent)
            ready.extend(negotiated)
        return ready, False

    def _band(self, vec: np.ndarray) -> np.ndarray:
        t = self._vec_t
        if len(vec) != len(t):
            t = torch.zeros(len(vec), dtype=torch.int64)
        t.numpy()[:] = vec
        # the process group's own call: dist.all_reduce's logging wrapper costs more than the
        # 136-byte collective itself on an idle cycle
        self._wait(self.ctrl_group.allreduce([self._hold(t)], self._band_opts),
                   "the bitvector all-reduce")
        self._count_ctrl(vec.nbytes, vec.nbytes)
        return t.numpy().copy()

    def _wait(self, work, what: str) -> None:
        """Wait for a collective, at most ``timeout_s``: a dead or stuck peer becomes an error."""
        try:
            ok = work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise ReduceError(f"{what} failed or timed out after {self.timeout_s:g} s (a peer "
                              f"rank died or stopped coordinating): {exc}") from exc
        if ok is False:
            raise ReduceError(f"{what} timed out after {self.timeout_s:g} s (a peer rank "
                              "stopped coordinating)")

    def _hold(self, *tensors):
        """Note the tensors of this cycle's gloo operations with their reference counts."""
        self._held_now.extend((t, use_count(t)) for t in tensors)
        return tensors[0] if len(tensors) == 1 else list(tensors)

    def _drain_held(self, timeout: float = 2.0) -> None:
        """Wait until gloo's worker threads have dropped their references to the last cycle's
        tensors. A worker drops them only after the waiter woke up, and dropping one takes the
        GIL (torch keeps the Python object alive while C++ holds references); if that happens
        while the interpreter shuts down, the worker thread is killed and the process aborts."""
        deadline = time.monotonic() + timeout
        for t, base in self._held_before + self._held_now:
            while use_count(t) > base and time.monotonic() < deadline:
                time.sleep(0.0005)
        self._held_before, self._held_now = [], []

    def _count_ctrl(self, sent: int, received: int, messages: int = 0,
                    collectives: int = 1) -> None:
        """Payload bytes this rank hands to / gets from control operations (whatever the
        collective's algorithm moves underneath), point-to-point messages, collectives."""
        c = self._cyc
        c["control_collectives"] += collectives
        c["control_bytes_sent"] += sent
        c["control_bytes_received"] += received
        c["control_messages"] += messages

    # -- master-worker -------------------------------------------------------------------

    def _exchange(self, requests: list[Request], shutdown: bool = False, busy: bool = True):
        """One master-worker round: gather new requests at rank 0, broadcast what is ready."""
        msg: dict[str, Any] = {"requests": [
            [r.name, list(r.params.shape), r.params.dtype, r.params.op, r.params.group]
            for r in requests]}
        if shutdown:
            msg["shutdown"] = True
        if busy:
            msg["busy"] = True
        payload = json.dumps(msg, separators=(",", ":")).encode()
        for r in requests:
            r.sent = True
        self._cyc["negotiated"] += len(requests)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        if self.rank == 0:
            sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.world)]
            self._wait(dist.gather(self._hold(size), self._hold(*sizes), dst=self._root,
                                   group=self.ctrl_group, async_op=True), "the request gather")
            self._count_ctrl(8, 8 * self.world)
            messages = [msg]
            received = 0
            for i in range(1, self.world):
                n = int(sizes[i].item())
                if not 0 < n <= _MAX_MESSAGE:
                    raise ReduceError(f"malformed coordination message from rank {i}: {n} bytes")
                buf = torch.empty(n, dtype=torch.uint8)
                self._wait(dist.irecv(self._hold(buf), src=self._global[i],
                                      group=self.ctrl_group), f"the requests of rank {i}")
                received += n
                messages.append(self._decode(buf, i))
            self._count_ctrl(0, received, self.world - 1, collectives=0)
            assert self._master is not None
            response = json.dumps(self._master.process(messages), separators=(",", ":")).encode()
            rsize = torch.tensor([len(response)], dtype=torch.int64)
            self._wait(dist.broadcast(self._hold(rsize), src=self._root, group=self.ctrl_group,
                                      async_op=True), "the response broadcast")
            rbuf = owned_bytes(response)
            self._wait(dist.broadcast(self._hold(rbuf), src=self._root, group=self.ctrl_group,
                                      async_op=True), "the response broadcast")
            self._count_ctrl(8 + len(response), 0, collectives=2)
            resp = json.loads(response)
        else:
            self._wait(dist.gather(self._hold(size), None, dst=self._root, group=self.ctrl_group,
                                   async_op=True), "the request gather")
            self._wait(dist.isend(self._hold(owned_bytes(payload)), dst=self._root,
                                  group=self.ctrl_group), "sending requests to rank 0")
            self._count_ctrl(8 + len(payload), 0, 1)     # the gather and the send
            rsize = torch.empty(1, dtype=torch.int64)
            self._wait(dist.broadcast(self._hold(rsize), src=self._root, group=self.ctrl_group,
                                      async_op=True), "the response broadcast")
            n = int(rsize.item())
            if not 0 < n <= _MAX_MESSAGE:
                raise ReduceError(f"malformed coordination response from rank 0: {n} bytes")
            rbuf = torch.empty(n, dtype=torch.uint8)
            self._wait(dist.broadcast(self._hold(rbuf), src=self._root, group=self.ctrl_group,
                                      async_op=True), "the response broadcast")
            self._count_ctrl(0, 8 + n, collectives=2)
            resp = self._decode(rbuf, 0)
        ready = []
        for name in resp["ready"]:
            got = self._pending.get(name)
            if got is None:
                raise ReduceError(f"rank 0 declared {name!r} ready but this rank never "
                                  "submitted it (coordination state diverged)")
            ready.append(got)
        for name, message in resp["errors"]:
            failed = self._pending.pop(name, None)
            if failed is not None:
                failed.handle._finish(error=ReduceMismatchError(message))
        self._idle_streak = 0 if resp.get("busy", True) else self._idle_streak + 1
        return ready, bool(resp.get("shutdown", False))

    @staticmethod
    def _decode(buf: torch.Tensor, rank: int) -> dict:
        try:
            msg = json.loads(buf.numpy().tobytes())
            if not isinstance(msg, dict):
                raise InvalidArgumentError("not an object")
            return msg
        except ValueError as exc:
            raise ReduceError(f"malformed coordination message from rank {rank}: {exc}") from None

    # -- execution -----------------------------------------------------------------------

    def _execute(self, ready: list[Request]) -> None:
        self._pool.extend(ready)     # ready on every rank; grouped ones wait for their group
        if not self._pool:
            return
        units = self._select()
        if not units:
            return
        buffers = self._fuse(units)
        if self.coordination == "bitvector":   # same order on every rank: caches stay equal
            for reqs in buffers:
                for r in reqs:
                    self.cache.put(r.name, r.params)
            if self.cache.evicted:
                evicted, self.cache.evicted = self.cache.evicted, []
                self._uncache(b for name, b in evicted
                              if b in self._hits and self._hits[b].name == name)
        t0 = time.perf_counter()
        works = [self._launch(reqs) for reqs in buffers]
        for _, work in works:
            self._wait(work, "a gradient all-reduce")
        rec = trace.active()
        if rec is not None:
            rec.span("comm", "allreduce", t0, time.perf_counter(),
                     count=sum(len(r) for r in buffers),
                     nbytes=sum(b.numel() * b.element_size() for b, _ in works),
                     args={"collectives": len(buffers), "coordination": self.coordination})
        self._commit()              # before any waiter wakes up and takes a snapshot
        for reqs, (buf, _) in zip(buffers, works):
            self._finish(reqs, buf)

    def _select(self) -> list[list[Request]]:
        """Units in pool order: single ungrouped tensors, and complete groups (group order)."""
        pooled = {r.name: r for r in self._pool}
        units, taken = [], set()
        for r in self._pool:
            if r.name in taken:
                continue
            g = r.params.group
            if g < 0:
                units.append([r])
                taken.add(r.name)
                continue
            members = self._groups.get(g, [r.name])
            if all(m in pooled for m in members):
                units.append([pooled[m] for m in members])
                taken.update(members)
        if taken:
            self._pool = [r for r in self._pool if r.name not in taken]
        return units

    def _fuse(self, units: list[list[Request]]) -> list[list[Request]]:
        """Greedy fusion of consecutive units of one dtype, device and op up to the threshold;
        a group is never split (unless its tensors differ in dtype or device)."""
        pieces: list[Any] = []
        for unit in units:
            by_key: dict[tuple, list[Request]] = {}
            for r in unit:
                by_key.setdefault((r.tensor.dtype, r.tensor.device, r.params.op), []).append(r)
            pieces.extend(by_key.items())
        buffers: list[Any] = []
        cur: list[Any] = []
        cur_key, cur_bytes = None, 0
        for key, reqs in pieces:
            nbytes = sum(r.nbytes for r in reqs)
            if cur and (key != cur_key or cur_bytes + nbytes > self.fusion_threshold):
                buffers.append(cur)
                cur, cur_bytes = [], 0
            cur = cur + reqs
            cur_key = key
            cur_bytes += nbytes
        if cur:
            buffers.append(cur)
        return buffers

    def _launch(self, reqs: list[Request]):
        if len(reqs) == 1:
            t = reqs[0].tensor
            buf = t if reqs[0].inplace and t.is_contiguous() else t.clone(
                memory_format=torch.contiguous_format)
        else:
            buf = flatten([r.tensor for r in reqs])
        nbytes = buf.numel() * buf.element_size()
        self._cyc["data_collectives"] += 1
        self._cyc["data_bytes"] += nbytes
        self._cyc_sizes.append(nbytes)
        return buf, dist.all_reduce(self._hold(buf), op=OPS[reqs[0].params.op],
                                    group=self.data_group, async_op=True)

    def _finish(self, reqs: list[Request], buf: torch.Tensor) -> None:
        if reqs[0].params.op == "average":
            buf.div_(self.world)
        if len(reqs) == 1:
            views = [buf.view(reqs[0].tensor.shape)]
        else:
            views = unflatten(buf, [r.tensor for r in reqs])
        dst = [(r.tensor, v) for r, v in zip(reqs, views)
               if r.inplace and v.data_ptr() != r.tensor.data_ptr()]
        if dst:
            torch._foreach_copy_([d for d, _ in dst], [v for _, v in dst])
        for r, v in zip(reqs, views):
            del self._pending[r.name]
            r.handle._finish(r.tensor if r.inplace else v)

    def _commit(self) -> None:
        with self._stats_lock:
            for k, v in self._cyc.items():
                self.counters[k] += v
                self._cyc[k] = 0
            self.fused_sizes.extend(self._cyc_sizes)
            self._cyc_sizes.clear()

    def snapshot(self, clear_sizes: bool = False) -> tuple[dict, list[int]]:
        """Consistent copies of the counters (whole cycles only) and the fused sizes."""
        with self._stats_lock:
            sizes = list(self.fused_sizes)
            if clear_sizes:
                self.fused_sizes.clear()
            return dict(self.counters), sizes

    def _warn_stalls(self) -> None:
        if self.stall_warning_s is None or not self._pending:
            return
        now = time.monotonic()
        for r in self._pending.values():
            if not r.warned and now - r.submitted > self.stall_warning_s:
                r.warned = True
                missing = self._master.missing(r.name) if self._master is not None else []
                who = f"; ranks that have not submitted it: {missing}" if missing else ""
                log.warning("rank %d: all-reduce of %r has waited %.0f s for the other ranks%s",
                            self.rank, r.name, now - r.submitted, who)
