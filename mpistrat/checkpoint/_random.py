"""Random generators a :class:`~mpistrat.checkpoint.Checkpoint` saves and restores: the
state of each, as JSON, and its checks as untrusted input.

A generator leaf is one of

* a ``numpy.random.Generator`` — its bit generator's own ``state`` dict (``PCG64``,
  ``MT19937``, ...), as NumPy gives it;
* a ``numpy.random.RandomState`` (``np.random.seed``'s global one included) —
  ``{"bit_generator": "RandomState", "key", "pos", "has_gauss", "gauss"}``;
* a ``random.Random`` (the ``random`` module's global one included) —
  ``{"bit_generator": "random.Random", "key", "pos", "gauss"}``;
* a ``torch.Generator`` (``torch.default_generator``, ``torch.manual_seed``'s, included)
  — ``{"bit_generator": "torch.Generator", "device", "state"}``.

The Mersenne Twister keys (624 words) and torch's state bytes are base64 strings, so
that taking a snapshot at every step boundary does not format thousands of integers.
``"bit_generator"`` names the family: a state restores only into a generator of the same
one (and a torch state into a generator of the same device type and state size).
torch is never imported here: a torch generator exists only where torch is imported.
"""

from __future__ import annotations

import array
import base64
import binascii
import json
import math
import random
import re
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["is_generator", "family", "get_state", "set_state", "check_state", "mismatch",
           "global_generators"]

_MT_WORDS = 624
_MT_BYTES = _MT_WORDS * 4
_PY = "random.Random"
_LEGACY = "RandomState"
_TORCH = "torch.Generator"
MAX_TORCH_STATE = 1 << 20  # bytes of a torch generator's state (a CPU one has 5056)
_DEVICE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,4})?")


def _torch_generator() -> type | None:
    torch = sys.modules.get("torch")
    return getattr(torch, "Generator", None) if torch is not None else None


def is_generator(obj: Any) -> bool:
    """Whether ``obj`` is a generator leaf (module docstring)."""
    if isinstance(obj, (np.random.Generator, np.random.RandomState)):
        return True
    if isinstance(obj, random.Random):  # (SystemRandom has no state to save)
        return not isinstance(obj, random.SystemRandom)
    cls = _torch_generator()
    return cls is not None and isinstance(obj, cls)


def family(obj: Any) -> str:
    """The family a generator's state is saved under (its ``"bit_generator"``)."""
    if isinstance(obj, np.random.Generator):
        return type(obj.bit_generator).__name__
    if isinstance(obj, np.random.RandomState):
        return _LEGACY
    if isinstance(obj, random.Random):
        return _PY
    return _TORCH


def _key(words: Any) -> str:
    """624 words (an array, or ``random``'s tuple of ints) as base64 of little-endian
    uint32."""
    if isinstance(words, np.ndarray) or array.array("I").itemsize != 4:
        raw = np.asarray(words).astype("<u4", copy=False).tobytes()
    else:  # (array.array: a third of NumPy's time from a tuple of ints)
        packed = array.array("I", words)
        if sys.byteorder == "big":
            packed.byteswap()
        raw = packed.tobytes()
    return base64.b64encode(raw).decode()


def _words(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text, validate=True), dtype="<u4").astype(np.uint32)


def get_state(obj: Any) -> dict[str, Any]:
    """``obj``'s state as JSON-able values (module docstring)."""
    if isinstance(obj, np.random.Generator):
        return _jsonable(obj.bit_generator.state)
    if isinstance(obj, np.random.RandomState):
        _, key, pos, has_gauss, gauss = obj.get_state(legacy=True)
        return {"bit_generator": _LEGACY, "key": _key(key), "pos": int(pos),
                "has_gauss": int(has_gauss), "gauss": float(gauss)}
    if isinstance(obj, random.Random):
        _, internal, gauss = obj.getstate()
        return {"bit_generator": _PY, "key": _key(internal[:-1]), "pos": int(internal[-1]),
                "gauss": gauss}
    state = obj.get_state()
    return {"bit_generator": _TORCH, "device": obj.device.type,
            "state": base64.b64encode(state.numpy().tobytes()).decode()}


def set_state(obj: Any, state: dict[str, Any]) -> None:
    """Set a state :func:`check_state` accepted (and :func:`mismatch` paired with
    ``obj``)."""
    if isinstance(obj, np.random.Generator):
        obj.bit_generator.state = state
    elif isinstance(obj, np.random.RandomState):
        obj.set_state(("MT19937", _words(state["key"]), state["pos"], state["has_gauss"],
                       state["gauss"]))
    elif isinstance(obj, random.Random):
        obj.setstate((3, (*(int(w) for w in _words(state["key"])), state["pos"]),
                      state["gauss"]))
    else:
        torch = sys.modules["torch"]
        raw = bytearray(base64.b64decode(state["state"], validate=True))
        obj.set_state(torch.frombuffer(raw, dtype=torch.uint8))


def mismatch(obj: Any, state: dict[str, Any]) -> str | None:
    """Why ``state`` (checked) does not restore into ``obj``, or None when it does."""
    ours = family(obj)
    if state["bit_generator"] != ours:
        return (f"holds a {state['bit_generator']} state, the object is a {ours}; restore it "
                f"into a generator of the kind it was saved from")
    if ours != _TORCH:
        return None
    if state["device"] != obj.device.type:
        return (f"holds the state of a torch generator on {state['device']}, the object is "
                f"on {obj.device.type}")
    size, ours_size = len(base64.b64decode(state["state"], validate=True)), \
        obj.get_state().numel()
    if size != ours_size:
        return (f"holds a torch generator state of {size} bytes, the object's has "
                f"{ours_size} (a different torch build or generator)")
    return None


def check_state(state: Any, bad: Callable[[Any, str], Exception]) -> dict[str, Any]:
    """A generator entry's state, checked as untrusted input: a NumPy bit generator's by
    setting it on a fresh one of the class it names, the others field by field (and a
    CPU torch generator's on a fresh one, where torch is imported)."""
    if not isinstance(state, dict):
        raise bad(state, "a generator's state (an object)")
    name = state.get("bit_generator")
    if name == _LEGACY:
        _fields(state, {"key", "pos", "has_gauss", "gauss"}, bad)
        _mt_key(state, bad)
        if state["has_gauss"] not in (0, 1) or isinstance(state["has_gauss"], bool):
            raise bad(state["has_gauss"], "0 or 1 in \"has_gauss\"")
        _finite(state["gauss"], bad)
        return _sets(np.random.RandomState(), state, bad)
    if name == _PY:
        _fields(state, {"key", "pos", "gauss"}, bad)
        _mt_key(state, bad)
        if state["gauss"] is not None:
            _finite(state["gauss"], bad)
        return _sets(random.Random(), state, bad)
    if name == _TORCH:
        _fields(state, {"device", "state"}, bad)
        device = state["device"]
        if not isinstance(device, str) or not _DEVICE.fullmatch(device):
            raise bad(device, "a torch device type (\"cpu\", \"cuda\") in \"device\"")
        raw = _base64(state["state"], MAX_TORCH_STATE, bad)
        cls = _torch_generator()
        if cls is not None and device == "cpu":
            torch = sys.modules["torch"]
            try:
                cls().set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, others
                raise bad(state["state"], f"a CPU torch generator's state "
                                          f"({type(exc).__name__}: {exc})") from None
        return state
    cls = getattr(np.random, name, None) if isinstance(name, str) and name.isidentifier() \
        else None
    if not (isinstance(cls, type) and issubclass(cls, np.random.BitGenerator)) or \
            cls is np.random.BitGenerator:
        raise bad(name, f"the name of a NumPy bit generator (PCG64, MT19937, ...), "
                        f"{_LEGACY!r}, {_PY!r} or {_TORCH!r} in \"bit_generator\"")
    try:
        cls().state = state
    except Exception as exc:  # noqa: BLE001 - NumPy's checks raise several types
        raise bad(state, f"a state {name} accepts ({type(exc).__name__}: {exc})") from None
    return state


def _sets(fresh: Any, state: dict[str, Any],
          bad: Callable[[Any, str], Exception]) -> dict[str, Any]:
    """``state``, once a fresh generator of its kind has taken it (so every rank's does)."""
    try:
        set_state(fresh, state)
    except Exception as exc:  # noqa: BLE001 - NumPy and random raise several types
        raise bad(state, f"a state a {state['bit_generator']} accepts "
                         f"({type(exc).__name__}: {exc})") from None
    return state


def _fields(state: dict[str, Any], names: set[str],
            bad: Callable[[Any, str], Exception]) -> None:
    found = set(state) - {"bit_generator"}
    if found != names:
        raise bad(sorted(found), f"the fields {sorted(names)} of a {state['bit_generator']} "
                                 f"state")


def _base64(text: Any, limit: int, bad: Callable[[Any, str], Exception]) -> bytes:
    if not isinstance(text, str) or len(text) > 4 * (limit // 3 + 1):
        raise bad(text, f"base64 text of at most {limit} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise bad(text, "base64 text") from None


def _mt_key(state: dict[str, Any], bad: Callable[[Any, str], Exception]) -> None:
    """A Mersenne Twister key (624 words) and position (0 to 624)."""
    if len(_base64(state["key"], _MT_BYTES, bad)) != _MT_BYTES:
        raise bad(state["key"], f"the base64 of {_MT_WORDS} 32-bit words in \"key\"")
    pos = state["pos"]
    if not isinstance(pos, int) or isinstance(pos, bool) or not 0 <= pos <= _MT_WORDS:
        raise bad(pos, f"an integer from 0 to {_MT_WORDS} in \"pos\"")


def _finite(value: Any, bad: Callable[[Any, str], Exception]) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or \
            not math.isfinite(value):
        raise bad(value, "a finite number in \"gauss\"")


def global_generators() -> dict[str, Any]:
    """The process's global generators, to list in a checkpoint so that a resumed run
    draws what the uninterrupted one would have: ``random``'s, NumPy's legacy one
    (``np.random.seed``, ``np.random.rand``) and, where torch is imported, torch's
    default CPU generator (``torch.manual_seed``, dropout on CPU)::

        ckpt = Checkpoint(model=model, optimizer=opt, step=step,
                          rng=mpistrat.checkpoint.global_generators())

    A restore gives every rank the chief's states (as it does every value): seed every
    rank alike, as data-parallel scripts do, and draw per-rank randomness from a
    generator made of the seed and the rank."""
    found: dict[str, Any] = {"python": random._inst,  # type: ignore[attr-defined]
                             "numpy": np.random.mtrand._rand}
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch"] = torch.default_generator
    return found


def _jsonable(state: Any) -> Any:
    """A bit generator's state as JSON (its big integers and arrays included)."""
    return json.loads(json.dumps(state, default=lambda o: o.tolist()))
