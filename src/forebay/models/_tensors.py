"""Tensors as stored bytes: their content hash (xxh3-128 over dtype, shape and bytes),
copies and reads that hash while the bytes are still in the cache, and the conversions
between stored bytes and torch tensors."""

from __future__ import annotations

import os
from typing import Any, Iterable, Optional

import numpy as np
import xxhash

__all__ = ["tensor_hash"]

_pool: Any = None


def _hasher() -> Any:
    """One helper thread for hashing (xxhash releases the GIL on large buffers)."""
    global _pool
    if _pool is None:
        from concurrent.futures import ThreadPoolExecutor

        _pool = ThreadPoolExecutor(1, thread_name_prefix="forebay-verify")
    return _pool


def _hash_head(dtype: str, shape: Iterable[int]) -> bytes:
    return f"{dtype}|{','.join(map(str, shape))}|".encode()


def tensor_hash(dtype: str, shape: Iterable[int], data: Any) -> str:
    """Content hash of a tensor: xxh3-128 of its dtype, shape and bytes."""
    h = xxhash.xxh3_128()
    h.update(_hash_head(dtype, shape))
    h.update(data)
    return h.hexdigest()


_COPY_CHUNK = 1 << 20  # copied, then hashed while still in the cache


def _halves(nbytes: list[int]) -> list[list[int]]:
    """Indices split in two by bytes, largest first, each to the lighter side."""
    sides: list[list[int]] = [[], []]
    load = [0, 0]
    for i in sorted(range(len(nbytes)), key=lambda i: -nbytes[i]):
        j = 0 if load[0] <= load[1] else 1
        sides[j].append(i)
        load[j] += nbytes[i]
    return sides


def _file_halves(offsets: list[int], nbytes: list[int]) -> list[list[int]]:
    """Indices in file order, cut in two at the tensor boundary nearest half the bytes:
    each side then reads one stretch of the file front to back (on its own descriptor,
    so the kernel's read-ahead sees a sequential reader)."""
    order = sorted(range(len(offsets)), key=lambda i: offsets[i])
    total, run, cut = sum(nbytes), 0, len(order)
    for j, i in enumerate(order):
        if run + nbytes[i] / 2 >= total / 2:
            cut = j
            break
        run += nbytes[i]
    return [order[:cut], order[cut:]] if cut else [order, []]


_GAP = 64 << 10   # tensors this close in the file are read by one call, the gap discarded
_IOV_MAX = 512    # well under every kernel's IOV_MAX (1,024 on Linux)


def _pread_and_hash(fd: int, jobs: list[tuple[np.ndarray, Any, bytes]]) -> list[Optional[str]]:
    """Read each ``(destination bytes, file offset, hash header)`` with ``preadv`` and
    hash it as it arrives; None where a read came back short or failed (the caller
    reads those another way).  Jobs given in file order whose bytes lie within
    ``_GAP`` of each other are read by one call covering up to 1 MiB of the file
    (small tensors: one system call and one sequential read for many of them, not a
    random read each); larger tensors in 1 MiB pieces, each hashed right after it
    arrives while it is in the cache."""
    hashes = []
    for _, _, head in jobs:
        h = xxhash.xxh3_128()
        h.update(head)
        hashes.append(h)
    ok = [True] * len(jobs)
    scratch = np.empty(_GAP, dtype=np.uint8)
    iovs: list[Any] = []
    pieces: list[tuple[int, np.ndarray]] = []
    start = pos = 0

    def flush() -> None:
        if not iovs:
            return
        try:
            good = os.preadv(fd, iovs, start) == pos - start
        except (OSError, OverflowError, TypeError, ValueError):   # a nonsense location
            good = False
        for i, piece in pieces:
            if not good:
                ok[i] = False
            elif ok[i]:
                hashes[i].update(memoryview(piece.data))
        iovs.clear()
        pieces.clear()

    for i, (dst, off, _) in enumerate(jobs):
        if not isinstance(off, int) or off < 0:
            ok[i] = False
            continue
        first = min(len(dst), _COPY_CHUNK)
        if iovs and 0 <= off - pos <= _GAP and off + first - start <= _COPY_CHUNK:
            if off > pos:
                iovs.append(scratch[:off - pos])
        else:
            flush()
            start = off
        pos = off
        for o in range(0, len(dst), _COPY_CHUNK):
            piece = dst[o:o + _COPY_CHUNK]
            if iovs and (pos + len(piece) - start > _COPY_CHUNK or len(iovs) >= _IOV_MAX):
                flush()
                start = pos
            iovs.append(piece)
            pieces.append((i, piece))
            pos += len(piece)
    flush()
    return [h.hexdigest() if good else None for h, good in zip(hashes, ok)]


def _copy_and_hash(jobs: list[tuple[np.ndarray, Any, bytes]]) -> list[str]:
    """Copy each ``(destination bytes, stored buffer, hash header)`` chunk by chunk and
    hash every chunk right after copying it, from the destination while it is in the
    cache: one pass over memory instead of a copy and a separate hashing pass, and the
    hash covers the bytes the caller gets.  numpy's copy and xxhash release the GIL."""
    out = []
    for dst, buf, head in jobs:
        src = np.frombuffer(buf, dtype=np.uint8)
        h = xxhash.xxh3_128()
        h.update(head)
        for o in range(0, len(src), _COPY_CHUNK):
            d = dst[o:o + _COPY_CHUNK]
            np.copyto(d, src[o:o + _COPY_CHUNK])
            h.update(d.data)
        out.append(h.hexdigest())
    return out


def _dtype_name(t: Any) -> str:
    return str(t.dtype).replace("torch.", "")


def _as_bytes(t: Any) -> np.ndarray:
    """A CPU tensor's bytes as a uint8 array (no copy when already contiguous on CPU;
    works for bfloat16 and other dtypes numpy lacks)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy()


_NP = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
       "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
       "uint8": np.uint8, "bool": np.uint8}


def _from_bytes(buf: Any, dtype: str, shape: list[int]) -> Any:
    """A new CPU tensor holding a copy of ``buf``."""
    import torch

    if dtype == "bool":
        return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8) != 0).reshape(shape)
    if len(buf) == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    raw = torch.from_numpy(np.array(np.frombuffer(buf, dtype=np.uint8)))
    return raw.view(getattr(torch, dtype)).reshape(shape)


def _byte_view(t: Any) -> np.ndarray:
    """A contiguous CPU tensor's memory as a writable uint8 array (no copy)."""
    import torch

    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _copy_into(dst: Any, buf: Any, dtype: str) -> None:
    """Copy stored bytes into tensor ``dst`` in place (straight into its memory on CPU)."""
    import torch

    with torch.no_grad():
        if dst.device.type == "cpu" and dst.is_contiguous() and dtype != "bool":
            view = dst.detach().reshape(-1).view(torch.uint8).numpy()
            view[:] = np.frombuffer(buf, dtype=np.uint8)
        else:
            dst.copy_(_from_bytes(buf, dtype, list(dst.shape)).to(dst.device))
