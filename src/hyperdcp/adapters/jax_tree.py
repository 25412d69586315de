"""JAX pytrees <-> flat state dicts of hyperdcp keys (the naming is documented in docs/JAX.md).

A pytree that holds at least one ``jax.Array`` (save) or ``jax.Array`` / ``jax.ShapeDtypeStruct``
(load) is flattened with ``jax.tree_util`` into ``{key: leaf}``, keys joined with ``"."`` from its key
path: a dict key as itself (``str`` or ``int``), a list or tuple index as its number, a namedtuple or
dataclass field by its name. ``{"params": {"dense": {"kernel": k}}, "opt": (ScaleByAdamState(count,
mu, nu),)}`` gives ``params.dense.kernel``, ``opt.0.count``, ``opt.0.mu.dense.kernel``, ... -- the same
names a nested dict of the same shape gets in torch, so checkpoints cross frameworks by name.

For loads, every array leaf becomes a :class:`JaxTarget` whose ``result`` the JAX adapter fills with the
new array; ``rebuild`` then makes the loaded pytree with the target's own structure (the target itself
is left untouched: JAX trees are values).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from ..errors import StateDictError


class JaxTarget:
    """One array leaf of a load target: the target (array or ShapeDtypeStruct) and the loaded array."""

    __slots__ = ("leaf", "result")

    def __init__(self, leaf: Any):
        self.leaf = leaf
        self.result: jax.Array | None = None

    @property
    def shape(self):
        return self.leaf.shape

    @property
    def dtype(self):
        return self.leaf.dtype


def _part(k: Any, path: tuple) -> str:
    tu = jax.tree_util
    if isinstance(k, tu.DictKey):
        key = k.key
        if type(key) not in (str, int):
            raise StateDictError(f"key {key!r} at {jax.tree_util.keystr(path)} is a {type(key).__name__}; hyperdcp "
                                 "keys must be str or int")
        return str(key)
    if isinstance(k, tu.SequenceKey):
        return str(k.idx)
    if isinstance(k, tu.GetAttrKey):
        return k.name
    if isinstance(k, tu.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def key_of(path: tuple) -> str:
    """The hyperdcp key of a ``jax.tree_util`` key path (``"params.dense.kernel"``, ``"opt.0.mu"``)."""
    return ".".join(_part(k, path) for k in path)


def _is_array_leaf(x: Any, for_load: bool) -> bool:
    return isinstance(x, jax.Array) or (for_load and isinstance(x, jax.ShapeDtypeStruct))


def flatten(tree: Any, for_load: bool) -> tuple[dict, Callable[[dict], Any]] | None:
    """``(flat, rebuild)`` for a pytree holding JAX arrays, else None (not a JAX tree: left to the others).

    ``flat`` maps keys to leaves (array leaves wrapped in :class:`JaxTarget` for loads); ``rebuild(flat)``
    is the pytree of the loaded values (missing keys keep the target's leaf).
    """
    if callable(getattr(tree, "state_dict", None)) and callable(getattr(tree, "load_state_dict", None)):
        return None
    is_leaf = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731 - a ShapeDtypeStruct is a leaf
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    if not any(_is_array_leaf(x, for_load) for _, x in pairs):
        return None
    flat: dict[str, Any] = {}
    for path, leaf in pairs:
        key = key_of(path)
        if key in flat:
            raise StateDictError(f"two leaves of the pytree are both named {key!r} ({jax.tree_util.keystr(path)}); "
                                 "rename one of them")
        if not path:
            raise StateDictError("the pytree is a single array; put it in a dict, e.g. {'w': array}")
        flat[key] = JaxTarget(leaf) if for_load and _is_array_leaf(leaf, True) else leaf
    keys = list(flat)

    def rebuild(done: dict) -> Any:
        out = []
        for k in keys:
            v = done[k]
            if isinstance(v, JaxTarget):
                v = v.result if v.result is not None else v.leaf
            out.append(v)
        return jax.tree_util.tree_unflatten(treedef, out)

    return flat, rebuild
