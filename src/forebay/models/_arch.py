"""Architecture capture: leaf layers, their structural configs, the edges between them, and
stable IDs by DStore's Algorithm 1 (a Merkle-style hash of each leaf's config with its
inputs' hashes, memoized: O(V + E)).

A *leaf* is a module that owns parameters or buffers itself.  Edges come from a
``torch.fx`` trace when the model is traceable (a leaf's inputs are the nearest leaves
upstream of it, through functions and parameter-free modules), else from module order
(each leaf's input is the previous leaf); ``Architecture.source`` says which.  IDs depend
on configs and edges only, never on attribute names or construction order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

import xxhash

__all__ = ["Leaf", "Architecture", "capture", "leaf_config", "stable_ids", "IdCache"]

# attributes that describe a layer's structure; anything else simple-typed on the module
# is taken too, except these (state, not structure)
_SKIP_ATTRS = {"training", "dump_patches", "call_super_init"}


@dataclass
class Leaf:
    name: str                      # module path in the model ("" for the root)
    config: dict[str, Any]         # class, tensors (name -> [shape, dtype]), attributes
    inputs: list[int] = field(default_factory=list)   # indices of upstream leaves
    id: str = ""                   # stable structural ID


@dataclass
class Architecture:
    leaves: list[Leaf]
    source: str                    # "fx" or "module order"

    def ids(self) -> dict[str, str]:
        """Module path -> stable ID."""
        return {lf.name: lf.id for lf in self.leaves}

    def encode(self) -> dict[str, Any]:
        """The compact graph stored with each version: small integer ids and input
        lists, the configs by hash."""
        return {"source": self.source,
                "nodes": [{"id": lf.id, "name": lf.name, "inputs": lf.inputs,
                           "config": config_hash(lf.config)} for lf in self.leaves]}


def _simple(v: Any) -> bool:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return True
    if isinstance(v, (tuple, list)):
        return all(_simple(x) for x in v)
    return False


def leaf_config(module: Any) -> dict[str, Any]:
    """Class, own parameters and buffers (shape, dtype) and simple-typed attributes
    (the constructor-relevant ones: ``in_features``, ``kernel_size``, ``eps``, ...)."""
    tensors = {}
    for kind, items in (("param", module.named_parameters(recurse=False)),
                        ("buffer", module.named_buffers(recurse=False))):
        for n, t in items:
            if t is not None:
                tensors[n] = [kind, list(t.shape), str(t.dtype).replace("torch.", "")]
    attrs = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(module).items()
             if not k.startswith("_") and k not in _SKIP_ATTRS and _simple(v)}
    return {"class": f"{type(module).__module__}.{type(module).__qualname__}",
            "tensors": dict(sorted(tensors.items())), "attrs": dict(sorted(attrs.items()))}


def config_hash(config: dict[str, Any]) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(config, sort_keys=True,
                                                separators=(",", ":")).encode())


class IdCache:
    """Client-side cache of config -> hash, so repeated saves of one architecture hash
    only configs not seen before (``hits``/``misses`` count it)."""

    def __init__(self) -> None:
        self._by_config: dict[str, str] = {}
        self.hits = self.misses = 0

    def config_hash(self, config: dict[str, Any]) -> str:
        key = json.dumps(config, sort_keys=True, separators=(",", ":"))
        h = self._by_config.get(key)
        if h is None:
            self.misses += 1
            h = self._by_config[key] = xxhash.xxh3_128_hexdigest(key.encode())
        else:
            self.hits += 1
        return h


def stable_ids(leaves: list[Leaf], cache: Optional[IdCache] = None) -> None:
    """Algorithm 1, iteratively: ``id(l) = H(H(config(l)), id(input_1), ...)`` in input
    order, each leaf hashed once.  Leaves with equal IDs (identical layers fed by the
    same inputs) get ``#k`` suffixes in graph order."""
    memo: dict[int, str] = {}
    chash = cache.config_hash if cache is not None else config_hash
    for root in range(len(leaves)):
        stack = [root]
        while stack:
            i = stack[-1]
            if i in memo:
                stack.pop()
                continue
            todo = [j for j in leaves[i].inputs if j not in memo]
            if todo:
                stack.extend(todo)
                continue
            h = xxhash.xxh3_128()
            h.update(chash(leaves[i].config).encode())
            for j in leaves[i].inputs:
                h.update(b"|" + memo[j].encode())
            memo[i] = h.hexdigest()
            stack.pop()
    seen: dict[str, int] = {}
    for i, lf in enumerate(leaves):
        k = seen.get(memo[i], 0)
        seen[memo[i]] = k + 1
        lf.id = memo[i] if k == 0 else f"{memo[i]}#{k}"


def _owns_tensors(m: Any) -> bool:
    return any(True for _ in m.parameters(recurse=False)) or \
        any(True for _ in m.buffers(recurse=False))


def capture(module: Any, cache: Optional[IdCache] = None) -> Architecture:
    """The leaf layers of ``module`` with edges and stable IDs."""
    named = [(n, m) for n, m in module.named_modules() if _owns_tensors(m)]
    arch = _capture_fx(module, named)
    if arch is None:
        leaves = [Leaf(n, leaf_config(m), [k - 1] if k else []) for k, (n, m) in
                  enumerate(named)]
        arch = Architecture(leaves, "module order")
    stable_ids(arch.leaves, cache)
    return arch


def _capture_fx(module: Any, named: list[tuple[str, Any]]) -> Optional[Architecture]:
    try:
        import torch.fx as fx
    except ImportError:  # pragma: no cover
        return None
    leaf_names = {n for n, _ in named}

    class Tracer(fx.Tracer):
        def is_leaf_module(self, m: Any, qualname: str) -> bool:
            return qualname in leaf_names or super().is_leaf_module(m, qualname)

    try:
        graph = Tracer().trace(module)
    except Exception:  # data-dependent control flow, unsupported ops: module order
        return None
    order: list[str] = []
    seen_at: dict[str, int] = {}  # leaf -> position in graph order
    ups: dict[Any, set[str]] = {}  # fx node -> leaf names feeding it (nearest)
    inputs: dict[str, list[str]] = {}
    for node in graph.nodes:
        src: list[str] = []
        for a in node.all_input_nodes:
            for u in sorted(ups.get(a, ()), key=seen_at.__getitem__):
                if u not in src:
                    src.append(u)
        target = node.target if node.op in ("call_module", "get_attr") else None
        owner = None
        if node.op == "call_module" and target in leaf_names:
            owner = target
        elif node.op == "get_attr":  # a parameter used directly: its module is the leaf
            mod = str(target).rpartition(".")[0]
            owner = mod if mod in leaf_names else None
        if owner is not None:
            if owner not in inputs:
                seen_at[owner] = len(order)
                order.append(owner)
                inputs[owner] = []
            for u in src:
                if u != owner and u not in inputs[owner]:
                    inputs[owner].append(u)
            ups[node] = {owner}
        else:
            ups[node] = set(src)
    missing = leaf_names - set(order)
    if missing:  # leaves the trace never called (unused, or reached another way)
        order += [n for n, _ in named if n in missing]
        for n in missing:
            inputs[n] = []
    pos = {n: k for k, n in enumerate(order)}
    mods = dict(named)
    leaves = [Leaf(n, leaf_config(mods[n]), [pos[u] for u in inputs[n]]) for n in order]
    return Architecture(leaves, "fx")
