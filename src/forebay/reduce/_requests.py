"""What a coordinator is asked to reduce: a submitted tensor (:class:`Request`), the
:class:`Handle` its caller waits on, flat buffers for fused reductions, and rank 0's
table of the master-worker coordination (:class:`MasterTable`)."""
from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ..errors import ReduceError
from ._cache import Params

__all__ = ["Handle", "Request", "MasterTable", "flatten", "unflatten", "use_count", "owned_bytes"]


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat copy of ``tensors`` (torch's C++ helper: no Python call per tensor)."""
    return torch._C._nn.flatten_dense_tensors(tensors)


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return torch._C._nn.unflatten_dense_tensors(flat, like)


def use_count(t: torch.Tensor) -> int:
    """C++ references to ``t``'s TensorImpl (0 where torch does not expose it)."""
    f = getattr(t, "use_count", None)
    return f() if f is not None else 0


def owned_bytes(data: bytes) -> torch.Tensor:
    """A uint8 tensor owning a copy of ``data`` (see ``Coordinator._band``)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


class Handle:
    """Completion of one submitted reduction; ``wait()`` returns the reduced tensor."""

    __slots__ = ("name", "_cond", "_done", "_result", "_error")

    def __init__(self, name: str, cond: threading.Condition):
        self.name = name
        self._cond = cond              # shared by a coordinator's handles: no Event per tensor
        self._done = False
        self._result: torch.Tensor | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if not self._done:
            with self._cond:
                if not self._cond.wait_for(lambda: self._done, timeout):
                    raise ReduceError(f"all-reduce of {self.name!r} did not complete within "
                                      f"{timeout} s (is every rank submitting it?)")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _finish(self, result=None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        with self._cond:
            self._done = True
            self._cond.notify_all()


class Request:
    __slots__ = ("name", "tensor", "params", "handle", "inplace", "event", "bit", "sent",
                 "submitted", "warned")

    def __init__(self, name: str, tensor: torch.Tensor, params: Params, handle: Handle,
                 inplace: bool, event=None):
        self.name, self.tensor, self.params, self.handle = name, tensor, params, handle
        self.inplace = inplace
        self.event = event            # a CUDA event recorded when the tensor was produced
        self.bit = -1                 # cache position while a cache hit
        self.sent = False             # reported to the master, waiting for the other ranks
        self.submitted = time.monotonic()
        self.warned = False

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class MasterTable:
    """Rank 0's message table: which ranks reported which tensor, with what parameters."""

    def __init__(self, world: int):
        self.world = world
        self.table: dict[str, list] = {}     # name -> [params, ranks set, error or None]

    def process(self, messages: list[dict]) -> dict:
        ready: list[Any] = []
        errors: list[Any] = []
        shutdown = busy = False
        for rank, msg in enumerate(messages):
            shutdown |= bool(msg.get("shutdown", False))
            busy |= bool(msg.get("busy", False))
            try:
                items = [(str(i[0]), Params(tuple(int(d) for d in i[1]), str(i[2]), str(i[3]),
                                            int(i[4]))) for i in msg["requests"]]
            except (KeyError, TypeError, IndexError, ValueError) as exc:
                raise ReduceError(f"malformed coordination message from rank {rank}: "
                                  f"{type(exc).__name__}: {exc}") from None
            for name, params in items:
                entry = self.table.get(name)
                if entry is None:
                    entry = self.table[name] = [params, {}, None]
                elif params != entry[0] and entry[2] is None:
                    first = next(iter(entry[1]))
                    entry[2] = (f"ranks disagree on tensor {name!r}: rank {first} sent "
                                f"{entry[0].describe()}, rank {rank} sent {params.describe()}")
                entry[1][rank] = True
                if len(entry[1]) == self.world:
                    del self.table[name]
                    (ready if entry[2] is None else errors).append(
                        name if entry[2] is None else [name, entry[2]])
        busy = busy or bool(self.table) or bool(ready)
        return {"ready": ready, "errors": errors, "shutdown": shutdown, "busy": busy}

    def missing(self, name: str) -> list[int]:
        entry = self.table.get(name)
        return [] if entry is None else [r for r in range(self.world) if r not in entry[1]]
