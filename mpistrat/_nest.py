"""Nests of arrays: tuples (named tuples included), lists and dicts, down to leaves.

A dataset element is a nest; everything that is not a tuple, list or dict is a leaf (an
array, a NumPy scalar, a string). Dicts are walked in sorted key order (as TensorFlow's
nest does), so ranks that built the same dict in different orders agree on its leaves;
two dicts match when they have the same keys.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["map_structure", "flatten", "pack_sequence_as", "describe"]


def map_structure(fn: Callable[..., Any], *structures: Any) -> Any:
    """Apply ``fn`` to the leaves at each position of ``structures`` (all of the same shape).

    Raises:
        ValueError: the structures differ (type, length or dict keys); the message shows them.
    """
    first = structures[0]
    if not isinstance(first, _CONTAINERS):
        if len(structures) > 1 and any(isinstance(s, _CONTAINERS) for s in structures):
            raise _mismatch(structures)
        return fn(*structures)
    if isinstance(first, dict):
        for other in structures[1:]:
            if not isinstance(other, dict) or other.keys() != first.keys():
                raise _mismatch(structures)
        items = [(key, map_structure(fn, *(s[key] for s in structures))) for key in _keys(first)]
        try:
            return type(first)(items)
        except TypeError:  # dict subclasses whose constructor takes other arguments
            return dict(items)
    for other in structures[1:]:
        if type(other) is not type(first) or len(other) != len(first):
            raise _mismatch(structures)
    if len(structures) == 1:
        children = [map_structure(fn, child) for child in first]
    else:
        children = [map_structure(fn, *parts) for parts in zip(*structures)]
    if isinstance(first, tuple) and hasattr(type(first), "_fields"):
        return type(first)(*children)
    return type(first)(children)


_CONTAINERS = (tuple, list, dict)


def _keys(mapping: dict) -> list[Any]:
    """A dict's keys in sorted order (TF's rule), so two processes that built the same
    dict in different orders flatten it the same way; insertion order if unsortable."""
    try:
        return sorted(mapping)
    except TypeError:
        return list(mapping)


def flatten(structure: Any) -> list[Any]:
    """The leaves of ``structure`` in :func:`map_structure` order."""
    leaves: list[Any] = []
    map_structure(leaves.append, structure)
    return leaves


def pack_sequence_as(structure: Any, leaves: list[Any]) -> Any:
    """``structure`` with its leaves replaced, in :func:`flatten` order, by ``leaves``."""
    items = iter(leaves)
    return map_structure(lambda _: next(items), structure)


def describe(structure: Any) -> str:
    """The shape of a nest with each leaf shown as ``shape dtype`` (for error messages)."""

    def leaf(value: Any) -> str:
        shape = getattr(value, "shape", None)
        dtype = getattr(value, "dtype", None)
        if shape is None:
            return type(value).__name__
        return f"{tuple(shape)} {dtype}"

    return repr(map_structure(lambda v: _Raw(leaf(v)), structure))


class _Raw(str):
    """A string whose repr is itself, so :func:`describe` prints leaves unquoted."""

    def __repr__(self) -> str:
        return str(self)


def _mismatch(structures: tuple[Any, ...]) -> ValueError:
    shown = " vs ".join(describe(s) for s in structures[:2])
    return ValueError(
        f"elements have different structures: {shown}; every element of a dataset (and "
        f"every value combined across replicas) must be the same nest of tuples, lists "
        f"and dicts"
    )
