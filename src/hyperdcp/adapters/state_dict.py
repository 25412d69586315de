"""Walking nested state dicts: names (FQNs), leaves, and in-place loading.

A leaf is a tensor-like value (array, tensor, DTensor) or a plain value. Containers (dict, list,
tuple) that hold no tensor are plain values themselves, stored whole. Objects with ``state_dict()``
and ``load_state_dict()`` are entered through ``state_dict()`` and restored through
``load_state_dict()``; both are called in an order every rank agrees on (a dict holding stateful
objects is walked by key; ``load_state_dict`` runs children first, then by name), whatever each
rank's dict order, as they may run collectives. Names join keys with ``"."``:
``{"model": {"w": t}}`` -> ``"model.w"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Iterator

from ..errors import StateDictError
from ..format import values as values_codec
from . import is_tensor_like

TENSOR, VALUE = "tensor", "value"


def _is_stateful(v: Any) -> bool:
    return (callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))
            and not is_tensor_like(v))


def _entries(d: dict) -> Iterable[tuple[Any, Any]]:
    """A dict's entries in walking order: its own, unless it holds stateful objects; then by key, so that
    every rank calls their ``state_dict()`` (which may run collectives) in the same order."""
    if any(_is_stateful(x) for x in d.values()):
        return sorted(d.items(), key=lambda kv: (str(kv[0]), type(kv[0]).__name__))
    return d.items()


def _join(prefix: str, key: Any) -> str:
    if type(key) not in (str, int):
        raise StateDictError(
            f"key {key!r} under {prefix or 'the top level'!r} is a {type(key).__name__}; "
            "state-dict keys must be str or int"
        )
    return f"{prefix}.{key}" if prefix else str(key)


def _kind(fqn: str, v: Any) -> str | None:
    if is_tensor_like(v):
        return TENSOR
    if values_codec.is_plain(v):
        return VALUE
    return None


def iter_leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """Yield ``(fqn, kind, value)`` for every leaf; raise StateDictError for unsupported values."""
    seen: set[str] = set()
    for fqn, kind, v in _walk(state, prefix):
        if fqn in seen:
            raise StateDictError(f"two entries of the state dict are both named {fqn!r}; rename one of them")
        seen.add(fqn)
        yield fqn, kind, v


def _walk(v: Any, fqn: str) -> Iterator[tuple[str, str, Any]]:
    kind = _kind(fqn, v)
    if kind is not None and (kind == TENSOR or fqn):
        yield fqn, kind, v
        return
    if _is_stateful(v):
        yield from _walk(v.state_dict(), fqn)
    elif isinstance(v, dict):
        for k, x in _entries(v):
            yield from _walk(x, _join(fqn, k))
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            yield from _walk(x, _join(fqn, i))
    else:
        values_codec.encode(v, fqn or "<state dict>")  # raises the explanatory error
        raise StateDictError(f"cannot checkpoint {fqn!r}")  # pragma: no cover


@dataclass
class LoadLeaf:
    fqn: str
    kind: str
    value: Any
    set: Callable[[Any], None]


def _post_key(path: tuple[str, ...]) -> tuple:
    """Sort key putting every node after all of its descendants (children first), else by name."""
    return tuple((0, p) for p in path) + ((1, ""),)


def _materialize(fqn: str, v: Any) -> Any | None:
    """A real CPU tensor to load into in place of a meta-device tensor ``v`` (None if ``v`` is not one)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not isinstance(v, torch.Tensor):
        return None
    from . import torch as _torch

    local = v._local_tensor if isinstance(v, _torch.DTensor) else v
    if type(local) is torch.Tensor or isinstance(local, torch.nn.Parameter):
        if local.device.type != "meta":
            return None
        if local is v:
            return torch.empty(v.shape, dtype=v.dtype, device="cpu")
        return _torch.DTensor.from_local(torch.empty_like(local, device="cpu"), v.device_mesh, v.placements,
                                         run_check=False, shape=v.size(), stride=v.stride())
    # shard containers (LocalShardsWrapper, legacy ShardedTensor): their shard tensors are the destinations
    shards = local.local_shards() if callable(getattr(local, "local_shards", None)) else []
    if any(getattr(sh, "tensor", sh).device.type == "meta" for sh in shards):
        raise StateDictError(f"cannot load into {fqn!r}: its shards are on the meta device; allocate them on a "
                             "real device first")
    return None


def leaves_for_load(state: Any) -> tuple[list[LoadLeaf], Callable[[], None]]:
    """Every leaf of ``state`` with a setter, and ``finish()`` which completes the load.

    Set new values through the leaves' setters (tensors are usually filled in place instead), then
    call ``finish()``: it rebuilds tuples and calls ``load_state_dict`` on stateful objects with the
    very dicts their ``state_dict()`` returned during this walk, children first and otherwise in
    order of their names, so that every rank calls them in the same order whatever its dict order
    (``load_state_dict`` may run collectives).

    A tensor on the meta device (torch) is loaded into a new CPU tensor of its shape and dtype (a
    DTensor keeps its mesh and placements), which ``finish()`` puts in its place, as torch DCP does;
    ``finish(skip)`` leaves the meta tensors of the keys in ``skip`` (the missing ones) where they are,
    so that no uninitialized memory ever takes their place.
    """
    leaves: list[LoadLeaf] = []
    post: list[tuple[tuple, int, Callable[[], None]]] = []
    seen: set[str] = set()
    materialized: dict[int, str] = {}  # index in post -> fqn of a meta tensor replaced by a real one

    def later(path: tuple[str, ...], action: Callable[[], None]) -> None:
        post.append((_post_key(path), len(post), action))

    def walk(v: Any, fqn: str, path: tuple[str, ...], setter: Callable[[Any], None]) -> None:
        kind = _kind(fqn, v)
        if kind is not None and (kind == TENSOR or fqn):
            if fqn in seen:
                raise StateDictError(f"two entries of the state dict are both named {fqn!r}; rename one of them")
            seen.add(fqn)
            real = _materialize(fqn, v) if kind == TENSOR else None
            if real is not None:
                materialized[len(post)] = fqn
                later(path, lambda: setter(real))
                v = real
            leaves.append(LoadLeaf(fqn, kind, v, setter))
            return
        if _is_stateful(v):
            sub = v.state_dict()
            box = [sub]
            walk(sub, fqn, path, lambda x: box.__setitem__(0, x))
            later(path, lambda: v.load_state_dict(box[0]))
        elif isinstance(v, dict):
            for k, x in _entries(v):
                walk(x, _join(fqn, k), path + (str(k),), lambda y, k=k: v.__setitem__(k, y))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, _join(fqn, i), path + (str(i),), lambda y, i=i: v.__setitem__(i, y))
        elif isinstance(v, tuple):
            items = list(v)
            for i, x in enumerate(items):
                walk(x, _join(fqn, i), path + (str(i),), lambda y, i=i: items.__setitem__(i, y))
            rebuild = (lambda: setter(type(v)(*items))) if hasattr(v, "_fields") else (lambda: setter(type(v)(items)))
            later(path, rebuild)
        else:
            values_codec.encode(v, fqn or "<state dict>")
            raise StateDictError(f"cannot load into {fqn!r}")  # pragma: no cover

    walk(state, "", (), lambda x: None)
    post.sort(key=lambda e: (e[0], e[1]))

    def finish(skip: Collection[str] = ()) -> None:
        for _, i, action in post:
            if materialized.get(i) not in skip:
                action()

    return leaves, finish
