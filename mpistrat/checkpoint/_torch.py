"""PyTorch leaves of a :class:`~mpistrat.checkpoint.Checkpoint`, imported only once a
torch object is among the leaves (``torch`` is then imported already: mpistrat itself
never imports it).

* a ``torch.Tensor`` is a value like a NumPy array (its dtype by NumPy's name: bfloat16
  through ml_dtypes), restored in place;
* a **stateful** object (``state_dict()``/``load_state_dict()``: a ``torch.nn.Module``, a
  ``torch.optim.Optimizer``, :class:`mpistrat.torch.ZeroRedundancyOptimizer`) is expanded
  each time it is saved into a JSON tree and the arrays of its tensors (:func:`expand`),
  since its structure may change (an optimizer's state appears at its first step), and
  restored by rebuilding the ``state_dict`` and calling ``load_state_dict``.

The tree is the state_dict with every tensor replaced by ``{"T": index}`` (its array),
and every container tagged so that it comes back as it was: ``{"d": [[key, value],
...]}`` for a dict (keys of any JSON-able type: an optimizer's state is keyed by int),
``{"l": [...]}`` a list, ``{"t": [...]}`` a tuple, ``{"f": "nan"}`` a float JSON cannot
hold; None, bools, ints, finite floats and strings stand for themselves. A tree read
back is untrusted input: :func:`decode` accepts only that grammar, at most
:data:`MAX_DEPTH` deep, every array used exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ..backends.torch_dtypes import numpy_dtype as _numpy_dtype

__all__ = ["is_stateful", "numpy_dtype", "describe", "host_value", "assign", "expand",
           "expand_value", "on_device", "host_piece", "renumber", "join_shards", "sharded",
           "decode", "check_fits", "signature", "gather", "needs_gather", "nbytes",
           "MAX_DEPTH"]

MAX_DEPTH = 64

def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and \
        callable(getattr(obj, "load_state_dict", None))


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype a tensor of ``dtype`` is saved as."""
    return _numpy_dtype(dtype, "checkpoint a tensor")


def describe(tensor: torch.Tensor) -> tuple[str, tuple[int, ...]]:
    return numpy_dtype(tensor.dtype).name, tuple(int(n) for n in tensor.shape)


def host_value(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's values as a NumPy array: a view of a contiguous CPU tensor (no copy),
    else a CPU copy."""
    dtype = numpy_dtype(tensor.dtype)
    value = tensor.detach()
    if value.device.type != "cpu":
        value = value.cpu()
    if not value.is_contiguous():
        value = value.contiguous()
    if value.dtype == torch.bfloat16:
        value = value.view(torch.int16)
    try:  # (not Tensor.numpy(): it marks the storage as never resizable again)
        array = np.from_dlpack(value)
    except Exception:  # noqa: BLE001 - older NumPy/torch pairs lack a dtype in DLPack
        array = value.numpy()
    return array.view(dtype) if array.dtype != dtype else array


def to_tensor(value: np.ndarray) -> torch.Tensor:
    """A new CPU tensor holding ``value`` (bfloat16 included)."""
    value = np.array(value, copy=True, order="C")
    if value.dtype.name == "bfloat16":
        return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(value)


def assign(tensor: torch.Tensor, value: np.ndarray) -> None:
    """Restore ``tensor`` in place (a parameter too)."""
    with torch.no_grad():
        tensor.copy_(to_tensor(value).view(tensor.shape))


# --- stateful objects ------------------------------------------------------------------


def expand(obj: Any, name: str, lazy: bool = False) -> tuple[Any, list[Any]]:
    """``obj.state_dict()`` as (the JSON tree, the arrays of its tensors; with ``lazy``
    a device tensor itself, detached, in place of its array: a snapshot brings to the
    host only the pieces it copies of it)."""
    return expand_value(obj.state_dict(), name, lazy)


def expand_value(state: Any, name: str, lazy: bool = False) -> tuple[Any, list[Any]]:
    """``state`` (a state_dict or part of one; of the object ``name``) as (the JSON tree,
    the arrays of its tensors, with ``lazy`` a device tensor itself in place of its
    array)."""
    arrays: list[Any] = []

    def encode(value: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"cannot checkpoint {name!r}: its state_dict nests deeper than "
                            f"{MAX_DEPTH} at {path}")
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value) if math.isfinite(value) else {"f": repr(float(value))}
        if isinstance(value, torch.Tensor):
            if lazy and on_device(value):
                numpy_dtype(value.dtype)  # (a dtype no checkpoint holds: refused now)
                arrays.append(value.detach())
            else:
                arrays.append(host_value(value))
            return {"T": len(arrays) - 1}
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return encode(value.item(), path, depth)
        if isinstance(value, (list, tuple)):
            items = [encode(v, f"{path}/{i}", depth + 1) for i, v in enumerate(value)]
            return {"l" if isinstance(value, list) else "t": items}
        if isinstance(value, Mapping):
            return {"d": [[encode(k, f"{path}/<key>", depth + 1),
                           encode(v, f"{path}/{k}", depth + 1)] for k, v in value.items()]}
        raise TypeError(f"cannot checkpoint {name!r}: its state_dict holds a "
                        f"{type(value).__name__} at {path or '/'}; a state_dict may hold "
                        f"tensors, None, bools, numbers, strings, lists, tuples and dicts")

    tree = encode(state, "", 0)
    return tree, arrays


def on_device(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s values are in device memory (a copy brings them to the host)."""
    return tensor.device.type != "cpu"


def host_piece(tensor: torch.Tensor, start: int, stop: int) -> np.ndarray:
    """Bytes ``start:stop`` of ``tensor``'s values in order (multiples of its element
    size), as a flat uint8 array in host memory: only those elements are copied from a
    device (none from a contiguous CPU tensor: a view)."""
    size = tensor.element_size()
    flat = tensor.detach().reshape(-1)[start // size:stop // size]
    return host_value(flat).reshape(-1).view(np.uint8)


def renumber(tree: Any, base: int) -> Any:
    """``tree`` (one :func:`expand_value` wrote) with every array index moved by
    ``base``: its arrays follow ``base`` others."""
    if isinstance(tree, dict):
        (tag, body), = tree.items()
        if tag == "T":
            return {"T": body + base}
        if tag in ("l", "t"):
            return {tag: [renumber(item, base) for item in body]}
        if tag == "d":
            return {"d": [[renumber(k, base), renumber(v, base)] for k, v in body]}
    return tree


def join_shards(shards: list[tuple[Any, int]], rest: tuple[Any, int]) -> Any:
    """The tree of a sharded optimizer's whole state_dict from its ranks' shares: each
    ``(tree, arrays)`` of :func:`expand_value` of a ``shard_state()``'s first part (their
    arrays numbered one share after the other), then ``rest``, its second part's (the
    ``param_groups``; its arrays last)."""
    entries: list[Any] = []
    base = 0
    for tree, count in shards:
        entries += renumber(tree, base)["d"]
        base += count
    return {"d": [["state", {"d": entries}], *renumber(rest[0], base)["d"]]}


def sharded(obj: Any) -> bool:
    """Whether ``obj`` keeps its state in shares its ranks can save side by side
    (:meth:`mpistrat.torch.ZeroRedundancyOptimizer.shard_state`)."""
    return callable(getattr(obj, "shard_state", None)) and \
        callable(getattr(obj, "shard_params", None)) and hasattr(obj, "shard_comm")


def decode(tree: Any, count: int, leaf: Callable[[int], Any]) -> Any:
    """The state_dict ``tree`` stands for, its ``{"T": i}`` replaced by ``leaf(i)``.

    Raises:
        ValueError: not a tree :func:`expand` writes (untrusted input), or an array
            index out of ``range(count)``, used twice or not at all.
    """
    used = [False] * count

    def walk(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"its state nests deeper than {MAX_DEPTH}")
        if node is None or isinstance(node, (bool, int, str)):
            return node
        if isinstance(node, float):
            return node
        if not isinstance(node, dict) or len(node) != 1:
            raise ValueError(f"its state holds {_short(node)}, not a value of the tree "
                             f"grammar")
        (tag, body), = node.items()
        if tag == "T":
            if not (isinstance(body, int) and not isinstance(body, bool)
                    and 0 <= body < count) or used[body]:
                raise ValueError(f"its state names array {_short(body)}: not one of its "
                                 f"{count} arrays, or one named twice")
            used[body] = True
            return leaf(body)
        if tag == "f":
            if body not in ("nan", "inf", "-inf"):
                raise ValueError(f"its state holds the float {_short(body)}")
            return float(body)
        if tag in ("l", "t") and isinstance(body, list):
            items = [walk(item, depth + 1) for item in body]
            return items if tag == "l" else tuple(items)
        if tag == "d" and isinstance(body, list):
            result: dict[Any, Any] = {}
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise ValueError(f"its state has a dict item {_short(pair)}")
                key = walk(pair[0], depth + 1)
                if isinstance(key, torch.Tensor) or not _hashable(key) or key in result:
                    raise ValueError(f"its state has a dict key {_short(pair[0])} that is "
                                     f"not a unique plain value")
                result[key] = walk(pair[1], depth + 1)
            return result
        raise ValueError(f"its state holds {_short(node)}, not a value of the tree grammar")

    state = walk(tree, 0)
    if not all(used):
        raise ValueError(f"its state leaves array {used.index(False)} unused")
    return state


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fits(obj: Any, name: str, state: Any) -> None:
    """Whether ``obj.load_state_dict(state)`` will take ``state`` (arrays in place of
    tensors), checked before any data moves.

    Raises:
        ValueError: saying what does not fit.
    """
    if not isinstance(state, dict):
        raise ValueError(f"entry {name!r} holds a {type(state).__name__}, not a state_dict")
    if isinstance(obj, torch.nn.Module):
        own = {k: v for k, v in obj.state_dict().items() if isinstance(v, torch.Tensor)}
        saved = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
        if set(own) != set(saved):
            raise ValueError(
                f"entry {name!r} holds the state of another module: missing "
                f"{sorted(set(own) - set(saved))[:5]}, unexpected "
                f"{sorted(str(k) for k in set(saved) - set(own))[:5]}; restore it into the "
                f"module it was saved from")
        for key, tensor in own.items():
            dtype, shape = describe(tensor)
            value = saved[key]
            if value.dtype.name != dtype or value.shape != shape:
                raise ValueError(f"entry {name!r}: {key} holds {value.dtype.name} of shape "
                                 f"{list(value.shape)}, the module's is {dtype} of shape "
                                 f"{list(shape)}; build the model with the shapes it was "
                                 f"saved with")
    elif isinstance(getattr(obj, "param_groups", None), list):
        groups = state.get("param_groups")
        if not isinstance(state.get("state"), dict) or not isinstance(groups, list) or \
                not all(isinstance(g, dict) and isinstance(g.get("params"), list)
                        for g in groups):
            raise ValueError(f"entry {name!r} is not an optimizer's state (\"state\" and "
                             f"\"param_groups\" with \"params\")")
        mine = [len(g["params"]) for g in obj.param_groups]
        theirs = [len(g["params"]) for g in groups]
        if mine != theirs:
            raise ValueError(f"entry {name!r} holds an optimizer of parameter groups of "
                             f"{theirs} parameters, the optimizer has {mine}; restore it "
                             f"into the optimizer it was saved from")
        if not all(isinstance(i, int) and not isinstance(i, bool)
                   for g in groups for i in g["params"]):
            raise ValueError(f"entry {name!r}: its parameter groups name parameters by "
                             f"other than integers")
        ids = {i for g in groups for i in g["params"]}
        if len(ids) != sum(theirs) or any(k not in ids for k in state["state"]):
            raise ValueError(f"entry {name!r}: its optimizer state names parameters its "
                             f"groups do not hold")


def signature(obj: Any) -> str:
    """What every rank must agree on about a stateful object: its class and structure."""
    if isinstance(obj, torch.nn.Module):
        return type(obj).__name__ + "{" + ";".join(
            f"{k}:{describe(v)[0]}{list(v.shape)}" for k, v in obj.state_dict().items()
            if isinstance(v, torch.Tensor)) + "}"
    groups = getattr(obj, "param_groups", None)
    if isinstance(groups, list):
        return f"{type(obj).__name__}{[len(g['params']) for g in groups]}"
    return type(obj).__name__


def gather(obj: Any, rank: int) -> None:
    """Make ``obj.state_dict()`` work on ``rank``: a sharded optimizer
    (``consolidate_state_dict``) gathers its state there. Collective for such an
    object: every rank of its communicator calls it, with the same rank (a rank of the
    checkpoint's communicator, which must be the optimizer's)."""
    consolidate = getattr(obj, "consolidate_state_dict", None)
    if callable(consolidate):
        consolidate(to=rank)


def nbytes(obj: Any) -> int:
    """The bytes of the tensors in ``obj.state_dict()``."""
    total = 0
    pending = [obj.state_dict()]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, Mapping):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return total


def needs_gather(obj: Any) -> bool:
    return callable(getattr(obj, "consolidate_state_dict", None))


def load(obj: Any, tree: Any, arrays: list[np.ndarray]) -> None:
    """Rebuild the state_dict from ``tree`` and ``arrays`` and load it into ``obj``."""
    obj.load_state_dict(decode(tree, len(arrays), lambda i: to_tensor(arrays[i])))
