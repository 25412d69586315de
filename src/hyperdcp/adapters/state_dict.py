"""Walking nested state dicts: names (FQNs), leaves, and in-place loading.

A leaf is a tensor-like value (array, tensor, DTensor) or a plain value. Containers (dict, list,
tuple) that hold no tensor are plain values themselves, stored whole. Objects with ``state_dict()``
and ``load_state_dict()`` are entered through ``state_dict()`` and restored through
``load_state_dict()``. Names join keys with ``"."``: ``{"model": {"w": t}}`` -> ``"model.w"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import StateDictError
from ..format import values as values_codec
from . import is_tensor_like

TENSOR, VALUE = "tensor", "value"


def _is_stateful(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None)) and not is_tensor_like(v)


def _join(prefix: str, key: Any) -> str:
    if type(key) not in (str, int):
        raise StateDictError(
            f"key {key!r} under {prefix or 'the top level'!r} is a {type(key).__name__}; state-dict keys must be str or int"
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
        for k, x in v.items():
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


def leaves_for_load(state: Any) -> tuple[list[LoadLeaf], Callable[[], None]]:
    """Every leaf of ``state`` with a setter, and ``finish()`` which completes the load.

    Set new values through the leaves' setters (tensors are usually filled in place instead), then
    call ``finish()``: it rebuilds tuples and calls ``load_state_dict`` on stateful objects with the
    very dicts their ``state_dict()`` returned during this walk, children first.
    """
    leaves: list[LoadLeaf] = []
    post: list[Callable[[], None]] = []
    seen: set[str] = set()

    def walk(v: Any, fqn: str, setter: Callable[[Any], None]) -> None:
        kind = _kind(fqn, v)
        if kind is not None and (kind == TENSOR or fqn):
            if fqn in seen:
                raise StateDictError(f"two entries of the state dict are both named {fqn!r}; rename one of them")
            seen.add(fqn)
            leaves.append(LoadLeaf(fqn, kind, v, setter))
            return
        if _is_stateful(v):
            sub = v.state_dict()
            box = [sub]
            walk(sub, fqn, lambda x: box.__setitem__(0, x))
            post.append(lambda: v.load_state_dict(box[0]))
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, _join(fqn, k), lambda y, k=k: v.__setitem__(k, y))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, _join(fqn, i), lambda y, i=i: v.__setitem__(i, y))
        elif isinstance(v, tuple):
            items = list(v)
            for i, x in enumerate(items):
                walk(x, _join(fqn, i), lambda y, i=i: items.__setitem__(i, y))
            rebuild = (lambda: setter(type(v)(*items))) if hasattr(v, "_fields") else (lambda: setter(type(v)(items)))
            post.append(rebuild)
        else:
            values_codec.encode(v, fqn or "<state dict>")
            raise StateDictError(f"cannot load into {fqn!r}")  # pragma: no cover

    walk(state, "", lambda x: None)

    def finish() -> None:
        for action in post:
            action()

    return leaves, finish
