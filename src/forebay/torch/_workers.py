"""Transform workers: the loader's per-sample ``transform`` (JPEG decode, augmentation)
in worker processes, fed by the store.

The store's batch (flat columnar buffers, one per field) goes to a worker as one
buffer in shared memory, gathered there by the store and reused (torch.multiprocessing
hands over its descriptor the first time, its id alone after), with the batch's ids,
offsets and shapes pickled in the message; the worker rebuilds the batch, transforms each sample and
collates them; the collated tensors come back through shared memory.  Batch
``step`` goes to worker ``step % workers``; results are handed out in plan order.

Random augmentations are reproducible whatever the number of workers when drawn from
:func:`sample_rng`, a NumPy generator seeded from ``(seed, epoch, sample id)``.  In a
worker process Python's, NumPy's and torch's global generators are seeded the same way
before each sample, so transforms using them are reproducible for a given number of
workers (and whatever it is, from 1 up); in the training process (``workers=0``) those
generators are the training's and are left alone.  A transform that raises, or a
worker that dies, fails the batch with an error naming it; nothing waits forever.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import signal
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Optional

import numpy as np

from ..dataset import SampleBatch, SampleViews
from ..errors import ForebayError, InvalidArgumentError
from ._handover import (HeldBuffers, SharedRing, _inline_small, _over, _pack,
                        _restore_small, _unpack, collate_shared)

__all__ = ["TransformError", "WorkerPool", "sample_rng", "sample_rngs", "transform_batch",
           "transform_samples", "seed_sample", "start_forkserver"]

def _ring_keep(workers: int) -> int:
    """Free input buffers the loader's SharedRing keeps for reuse."""
    return 6 * workers + 2


def _held_size(workers: int) -> int:
    """Input buffers a worker keeps mapped: as many as the loader's SharedRing keeps
    free and has in flight (4 per worker), so that a reused buffer is one the worker
    holds."""
    return _ring_keep(workers) + 4 * workers

#: seconds between liveness checks of the workers while a result is awaited
_POLL_S = 0.5
#: seconds a transform worker may take on one batch before the loader raises (the
#: loader's ``worker_timeout``; None: no limit)
DEFAULT_TIMEOUT_S = 600.0


#: what a fork server preloads, so that a worker forked from it imports nothing more
#: than the training script (and what it imports beyond these)
_FORKSERVER_PRELOAD = ["numpy", "torch", "forebay.torch._workers"]


class TransformError(ForebayError, RuntimeError):
    """A sample's transform raised, or a transform worker died."""


def _picklable(fn: Any) -> Optional[str]:
    """None if ``fn`` pickles (by reference, as a worker receives it), else why not."""
    try:
        pickle.dumps(fn)
        return None
    except Exception as e:   # noqa: BLE001 - any pickling failure
        return f"{type(e).__name__}: {e}"


def start_forkserver() -> None:
    """Start the fork server now (it imports torch, about a second), so that it is
    ready when the workers are made: the loader calls this before its store's set-up."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(_FORKSERVER_PRELOAD)
    forkserver.ensure_running()


def _check_pool_args(workers: Any, timeout: Any) -> None:
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidArgumentError(f"workers must be a positive integer, got {workers!r}")
    if timeout is not None and (isinstance(timeout, bool) or
                                not isinstance(timeout, (int, float)) or
                                not 0 < timeout < float("inf")):
        raise InvalidArgumentError(f"worker_timeout must be a number of seconds > 0 or "
                                   f"None, got {timeout!r}")


_current = threading.local()


_MASK = (1 << 64) - 1


def _mix(*parts: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps): cheap, and the same everywhere."""
    x = 0x9E3779B97F4A7C15
    for v in parts:
        x = (x ^ (int(v) & _MASK)) & _MASK
        x = (x + 0x9E3779B97F4A7C15) & _MASK
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
    return x


def seed_sample(seed: int, epoch: int, sample_id: int, globals_too: bool = True) -> None:
    """Set what :func:`sample_rng` returns for one sample (made when first asked for)
    and, ``globals_too``, seed Python's, NumPy's and torch's global generators (a
    worker process's own; never in the training process, whose generators belong to
    the training).  About 15 us."""
    x = _mix(seed, epoch, sample_id)
    _current.key = x
    _current.rng = None
    _current.seed_epoch = (seed, epoch)
    if globals_too:
        import random

        import torch

        random.seed(x)
        np.random.seed(x & 0xFFFFFFFF)
        # the CPU generator only (torch.manual_seed also visits every device: 150 us)
        torch.default_generator.manual_seed(x >> 1)


def sample_rng() -> np.random.Generator:
    """The NumPy generator of the sample being transformed (seeded from seed, epoch
    and sample id: the same whatever the number of workers)."""
    key = getattr(_current, "key", None)
    if key is None:
        raise InvalidArgumentError("sample_rng() is for use inside a loader's transform")
    if _current.rng is None:
        _current.rng = np.random.default_rng(key)
    return _current.rng


def sample_rngs(ids: "np.ndarray | list[int]") -> list[np.random.Generator]:
    """For a ``batch_transform``: one NumPy generator per sample id of the batch, each
    the one :func:`sample_rng` gives that sample in a per-sample ``transform`` (seeded
    from seed, epoch and sample id), so a batched augmentation draws what the
    per-sample one would."""
    se = getattr(_current, "seed_epoch", None)
    if se is None:
        raise InvalidArgumentError("sample_rngs() is for use inside a loader's "
                                   "batch_transform")
    return [np.random.default_rng(_mix(se[0], se[1], int(i))) for i in ids]


def transform_batch(batch: "SampleBatch | SampleViews", transform: Optional[Callable],
                    batch_transform: Optional[Callable], collate_fn: Optional[Callable],
                    seed: int, epoch: int, in_worker: bool = False) -> Any:
    """What a worker (or the loader's own thread) does with one batch."""
    from ._collate import collate_samples

    if in_worker and collate_fn is None:
        collate_fn = collate_shared
    if batch_transform is not None:
        seed_sample(seed, epoch, int(batch.ids[0]) if len(batch.ids) else 0, in_worker)
        return batch_transform(batch)
    return collate_samples(transform_samples(batch, transform, seed, epoch, 0,
                                             len(batch.ids), in_worker), collate_fn)


def transform_samples(batch: "SampleBatch | SampleViews", transform: Optional[Callable],
                      seed: int, epoch: int, start: int, stop: int,
                      in_worker: bool = False) -> list[Any]:
    """``transform`` applied to samples ``[start, stop)`` of ``batch``, each with its
    own seed (:func:`seed_sample`): a part of :func:`transform_batch`, the same samples
    whichever thread or process runs it."""
    out = []
    for k, sid in enumerate(batch.ids[start:stop].tolist(), start):
        seed_sample(seed, epoch, sid, in_worker)
        try:
            out.append(transform(batch.sample(k)) if transform is not None
                       else batch.sample(k))
        except Exception as e:
            raise TransformError(f"the transform failed on sample {sid} (epoch {epoch}): "
                                 f"{type(e).__name__}: {e}") from e
    return out


def _input_buffer(payload: Any, held: HeldBuffers, wid: int) -> Any:
    """The shared buffer a batch's message brings (kept in ``held``) or names by the
    id of one ``held`` already (put in the message); None for a message without one."""
    bid = payload.get("buffer_id") if isinstance(payload, dict) else None
    if bid is None:
        return None
    if "buffer" in payload:
        if held.see(bid, payload["buffer"]):
            raise TransformError(f"transform worker {wid} was sent buffer {bid}, which it "
                                 f"holds already: the loader's record of its buffers is wrong")
        return payload["buffer"]
    if not held.see(bid):
        raise TransformError(f"transform worker {wid} was sent buffer {bid} by its id, "
                             f"which it does not hold: the loader's record of its buffers "
                             f"is wrong")
    payload["buffer"] = held.get(bid)
    return payload["buffer"]


def _worker_main(wid: int, inbox: Any, outbox: Any, schema: Any, transform: Any,
                 batch_transform: Any, collate_fn: Any, seed: int, parent: Optional[int],
                 verify_on_read: bool, held_size: int) -> None:
    """A worker: transform batches until told to stop (None) or the loader dies.  A
    batch comes as its samples (in shared memory) or as ids and the dataset directory
    to read them from (the loader's direct mode), opened on first use.  ``parent``:
    the loader's pid, or None when started from a fork server (its parent then);
    ``held_size``: how many input buffers it keeps mapped (:func:`_held_size`, the
    loader's ring)."""
    from ..dataset.sources._base import _die_with_parent

    _die_with_parent(os.getppid() if parent is None else parent)  # ignores Ctrl-C
    import torch

    torch.set_num_threads(1)
    opened: dict[str, Any] = {}
    # the last input buffers stay mapped here: the loader reuses them (SharedRing) and
    # sends one held here by its id alone
    held = HeldBuffers(held_size)
    outbox.put((("ready", wid), None, None, None, False))  # the timeout counts from now
    while True:
        msg = inbox.get()
        if msg is None:
            return
        key, payload = msg
        read = None
        buffer = None
        try:
            buffer = _input_buffer(payload, held, wid)
            if isinstance(payload, tuple):   # (ids, the dataset's locator): it reads them
                ids, path = payload
                if path not in opened or int(ids.max()) >= len(opened[path]):   # it grew
                    from ..dataset import open_locator

                    opened[path] = open_locator(path, verify_on_read=verify_on_read)
                t0 = time.perf_counter()
                batch = opened[path].get_many(ids)
                read = (t0, time.perf_counter())
            else:
                batch = _unpack(payload, schema)
            out = transform_batch(batch, transform, batch_transform,
                                  collate_fn, seed, key[1], in_worker=True)
            aliased = buffer is not None and _over(out, buffer)
            outbox.put((key, _inline_small(out), None, read, aliased))
        except BaseException as e:    # noqa: BLE001 - reported with the batch
            outbox.put((key, None, (f"{type(e).__name__}: {e}", traceback.format_exc()),
                        read, False))


class _Pending:
    """A batch in a worker: :meth:`result` waits for it (in plan order, by the
    loader's consumer).  ``on_read(t0, t1)``, if set, is called with the seconds
    (``time.perf_counter``, the same clock in every process of the node) the worker
    spent reading the batch's samples from the dataset files (``submit_ids``)."""

    def __init__(self, pool: Any, key: tuple[int, int, int], wid: int,
                 ids: np.ndarray) -> None:
        self.pool, self.key, self.wid, self.ids = pool, key, wid, ids
        self.on_read: Optional[Callable[[float, float], None]] = None

    def result(self) -> Any:
        return self.pool._wait(self)


def _process_state(pid: Optional[int]) -> str:
    """What /proc says process ``pid`` is doing ("stopped", "sleeping", ...), or ""."""
    names = {"R": "running", "S": "sleeping", "D": "waiting on I/O", "T": "stopped",
             "t": "stopped by a debugger", "Z": "a zombie"}
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return names.get(code, f"state {code}")


class WorkerPool:
    """``workers`` processes applying ``transform`` (or ``batch_transform``) to the
    batches submitted to them."""

    def __init__(self, workers: int, schema: Any, transform: Optional[Callable],
                 batch_transform: Optional[Callable], collate_fn: Optional[Callable],
                 seed: int, start_method: str = "spawn", *,
                 timeout: Optional[float] = DEFAULT_TIMEOUT_S,
                 verify_on_read: bool = False) -> None:
        import torch.multiprocessing as mp

        _check_pool_args(workers, timeout)
        self.timeout = timeout
        #: when each worker said it was ready (imports done): a batch's timeout counts
        #: from then, not through a slow start
        self._ready_at: dict[int, float] = {}
        if start_method not in ("spawn", "fork", "forkserver"):
            raise InvalidArgumentError(f"worker_start must be 'spawn', 'fork' or "
                                       f"'forkserver', got {start_method!r}")
        for what, fn in (("transform", transform), ("batch_transform", batch_transform),
                         ("collate_fn", collate_fn)):
            why = _picklable(fn) if fn is not None and start_method != "fork" else None
            if why is not None:
                raise InvalidArgumentError(
                    f"{what} must be picklable to run in worker processes started by "
                    f"{start_method!r} (a function defined at module level, not a lambda or "
                    f"a local function), or pass worker_start='fork': {why}")
        if start_method == "forkserver":
            start_forkserver()          # (already running when the loader started it)
        ctx: Any = mp.get_context(start_method)
        self.start_method = start_method
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(workers)]
        parent = None if start_method == "forkserver" else os.getpid()
        self._procs = [ctx.Process(target=_worker_main, name=f"forebay-transform-{w}",
                                   args=(w, self._inboxes[w], self._outbox, schema, transform,
                                         batch_transform, collate_fn, seed, parent,
                                         verify_on_read, _held_size(workers)),
                                   daemon=True) for w in range(workers)]
        with warnings.catch_warnings():
            # Python 3.12+ warns at any fork of a process with more than one OS thread;
            # forebay forks only when no other Python thread runs (fork_hazards), and
            # native thread pools (OpenBLAS, OpenMP) reset themselves in the child
            warnings.filterwarnings("ignore", message=r".*use of fork\(\) may lead to "
                                    r"deadlocks", category=DeprecationWarning)
            # a forked worker's first garbage collection would write to every object
            # it inherited, copying the training process's heap page by page (its first
            # batch took 2.4x longer): the objects stay out of its collections
            freeze = start_method == "fork"
            if freeze:
                gc.freeze()
            try:
                for p in self._procs:
                    p.start()
            finally:
                if freeze:
                    gc.unfreeze()
        self._done: dict[tuple[int, int, int], tuple[Any, Any, Any]] = {}
        #: the batches' input buffers (the batches in flight, at least 4 per worker)
        self.ring = SharedRing(keep=_ring_keep(workers))
        #: the buffers each worker holds (its own record, mirrored)
        self._held = [HeldBuffers(_held_size(workers)) for _ in range(workers)]
        #: batches whose buffer went by its id alone (the worker held it)
        self.by_id = 0
        #: one per pass over an epoch: results of an abandoned pass are never taken
        self.generation = 0
        self._lock = threading.Condition()
        self._closed = False

    @property
    def workers(self) -> int:
        return len(self._procs)

    def submit(self, epoch: int, step: int, batch: SampleBatch, shared: Any = None
               ) -> _Pending:
        """Hand a batch to its worker (``shared``: the shared tensor the store gathered
        it into, see :class:`SharedAlloc`)."""
        if self._closed:
            raise TransformError("the transform workers are closed")
        wid = step % len(self._procs)
        key = (self.generation, epoch, step)
        held = False
        if shared is not None:
            self.ring.lend(key, shared)
            held = self._held[wid].see(shared.forebay_buffer_id)
            self.by_id += held
        self._inboxes[wid].put((key, _pack(batch, shared, held)))
        return _Pending(self, key, wid, batch.ids)

    def submit_ids(self, epoch: int, step: int, ids: np.ndarray, path: Any) -> _Pending:
        """Hand a batch to its worker by sample ids: the worker reads them from the
        dataset at ``path`` (a :attr:`~forebay.dataset.PackedDataset.locator`) itself
        (the loader's direct mode: nothing crosses but the ids)."""
        if self._closed:
            raise TransformError("the transform workers are closed")
        wid = step % len(self._procs)
        key = (self.generation, epoch, step)
        # the ids pickled with the message (a tensor would cross as a shared memory file)
        self._inboxes[wid].put((key, (np.ascontiguousarray(ids), path)))
        return _Pending(self, key, wid, ids)

    def _wait(self, p: _Pending) -> Any:
        t0 = time.monotonic()
        while True:
            with self._lock:
                if p.key in self._done:
                    out, err, read = self._done.pop(p.key)
                    break
            try:
                key, out, err, read, aliased = self._outbox.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive(p)
                self._check_others()
                if self.timeout is not None:
                    since = max(t0, self._ready_at.get(p.wid, float("inf")))
                    if since == float("inf") and \
                            _process_state(self._procs[p.wid].pid) == "stopped":
                        since = t0            # stopped before it was ready
                    if time.monotonic() - since > self.timeout:
                        self._timed_out(p)
                continue
            except (OSError, EOFError, RuntimeError) as e:
                # a result whose sender died before handing over its shared memory
                self._check_alive(p, e)
                dead = ", ".join(f"transform worker {w} (pid {q.pid}) died with exit code "
                                 f"{q.exitcode}" for w, q in enumerate(self._procs)
                                 if not q.is_alive())
                raise TransformError(f"{dead or 'a transform worker failed'}: a result it "
                                     f"was sending could not be received "
                                     f"({type(e).__name__}: {e})") from e
            if key[0] == "ready":
                self._ready_at[key[1]] = time.monotonic()
                continue
            self.ring.back(key, not aliased)        # the worker is done with its input
            if key == p.key:
                break
            if key[0] == self.generation:
                with self._lock:
                    self._done[key] = (out, err, read)
        if read is not None and p.on_read is not None:
            p.on_read(*read)
        out = _restore_small(out)
        if err is not None:
            msg, tb = err
            raise TransformError(f"batch of epoch {p.key[1]} step {p.key[2]}: {msg}\n"
                                 f"(in transform worker {p.wid}:)\n{tb}")
        return out

    def _check_alive(self, p: _Pending, cause: Optional[BaseException] = None) -> None:
        """Raise if the worker holding ``p`` has died (or dies within a moment when a
        received result was broken by its death)."""
        proc = self._procs[p.wid]
        if cause is not None:
            proc.join(timeout=5)           # the broken hand-over means it is going
        if not proc.is_alive():
            if p.wid not in self._ready_at:
                raise TransformError(
                    f"transform worker {p.wid} (pid {proc.pid}) died with exit code "
                    f"{proc.exitcode} while starting, before it took a batch"
                    f"{self._start_hint()}") from cause
            raise TransformError(
                f"transform worker {p.wid} (pid {proc.pid}) died with exit code "
                f"{proc.exitcode} while transforming the batch of epoch {p.key[1]} "
                f"step {p.key[2]} (samples {p.ids[:8].tolist()}"
                f"{'...' if len(p.ids) > 8 else ''})") from cause

    def _check_others(self) -> None:
        """Raise if any worker died: one killed while sending a result leaves the
        results queue's lock held and the others blocked behind it."""
        for w, proc in enumerate(self._procs):
            if not proc.is_alive():
                raise TransformError(
                    f"transform worker {w} (pid {proc.pid}) died with exit code "
                    f"{proc.exitcode}: the other workers' results cannot be trusted to "
                    f"come back past it, so the loader stops here")

    def _start_hint(self) -> str:
        """Why a worker dies while starting, where the start method explains it: a
        spawned worker is a fresh Python that imports the main script first."""
        import sys

        main = getattr(sys.modules.get("__main__"), "__file__", None)
        if self.start_method == "fork" or not main:
            return " (its error is above)"
        how = "forked from a fork server" if self.start_method == "forkserver" \
            else "a fresh Python"
        return (f": with worker_start={self.start_method!r} each worker, {how}, first "
                f"imports your script {main} (its error is above); a script "
                f"that builds the loader at its top level must do so under "
                f"`if __name__ == \"__main__\":`, or pass worker_start='fork'")

    def _timed_out(self, p: _Pending) -> None:
        """The worker holding ``p`` returned nothing within the timeout: raise naming it,
        its state and the batch (as torch's DataLoader ``timeout=``)."""
        proc = self._procs[p.wid]
        state = _process_state(proc.pid)
        raise TransformError(
            f"transform worker {p.wid} (pid {proc.pid}{', ' + state if state else ''}) "
            f"returned nothing for {self.timeout:g} s on the batch of epoch {p.key[1]} "
            f"step {p.key[2]} (samples {p.ids[:8].tolist()}"
            f"{'...' if len(p.ids) > 8 else ''}): a transform that deadlocked, or a "
            f"stopped worker; a transform that needs longer: worker_timeout=SECONDS "
            f"(None: wait forever)")

    def new_pass(self) -> None:
        """A new pass over an epoch: results of earlier passes nobody took (an epoch
        left early) are dropped, now and when they arrive."""
        with self._lock:
            self.generation += 1
            self._done.clear()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for q in self._inboxes:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self._procs:
            if _process_state(p.pid) == "stopped":
                p.kill()                     # it would never read the stop message
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for q in [*self._inboxes, self._outbox]:
            q.cancel_join_thread()
            q.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            if not self._closed:
                for p in self._procs:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
        except Exception:         # noqa: BLE001
            pass
