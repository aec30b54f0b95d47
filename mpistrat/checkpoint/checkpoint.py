"""``Checkpoint``: save the training state from the chief, restore it on every rank.

The objects are named keyword arguments, as in ``tf.train.Checkpoint``; each may be a
dict, list or tuple of further objects. A leaf is anything with ``numpy()`` and
``assign(value)`` (mpistrat's variables, :class:`Scalar`), a NumPy array or a
``torch.Tensor`` (restored in place), a random generator (a ``numpy.random.Generator``,
``RandomState``, ``random.Random`` or ``torch.Generator``: its state is saved, so shuffles
and dropout resume too; :func:`global_generators` gives the process's global ones), or a
*stateful* object with ``state_dict()`` and ``load_state_dict()`` (a
``torch.nn.Module``, a ``torch.optim.Optimizer``,
:class:`mpistrat.torch.ZeroRedundancyOptimizer`, whose state is gathered on the rank
that writes, collectively, first): its state_dict is expanded into arrays and a JSON tree
each time it is saved (:mod:`mpistrat.checkpoint._torch`), so its structure may change
between saves (an optimizer's state appears at its first step). torch is never imported
here unless a torch object is among the leaves.
Values are numeric (bool, integers, floats, complex, datetime64/timedelta64) or one of
ml_dtypes' types (bfloat16, ...); strings and structured arrays are refused when saving.

``save``/``write``/``restore`` are collective: every rank calls them. Saving writes the
chief's values (in synchronous training every rank holds the same), from the chief only,
atomically and under the directory's lock (see :mod:`mpistrat.checkpoint._files`), and
returns once the files are durable — or raises the chief's error on every rank. Restoring
reads on the chief only: it checks the whole manifest as untrusted input, the data against
the manifest's size and checksum, every member's dtype and shape against the manifest, and
the manifest against the objects, then broadcasts its verdict before any data moves. A
missing, torn, forged or mismatching checkpoint is therefore the same error on every rank
(and no object has changed); otherwise the values are broadcast, identical on every rank
by construction, ranks need not share a file system, and a large job does not have every
rank read the same file at once.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from ..errors import TopologyError
from ..runtime import recorder
from ..runtime._mpi import Comm, state_comm
from ..runtime.agreement import agree
from . import _files, _random
from ._files import CheckpointCorruptError, CheckpointNotFoundError

__all__ = ["Checkpoint", "Scalar", "CheckpointNotFoundError", "CheckpointCorruptError"]


class Scalar:
    """A number a checkpoint restores in place: a step counter, an epoch, a learning rate.

    Args:
        value: the initial value.
        dtype: its NumPy dtype (default: inferred, e.g. int64 for ``0``).
    """

    def __init__(self, value: Any = 0, dtype: Any = None) -> None:
        self._value = np.array(value, dtype=dtype)
        if self._value.ndim != 0:
            raise ValueError(f"Scalar holds one number, got shape {self._value.shape}; use a "
                             f"NumPy array for more")

    @property
    def value(self) -> Any:
        """The number as a Python int/float/bool."""
        return self._value.item()

    @property
    def dtype(self) -> np.dtype:
        return self._value.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return ()

    def numpy(self) -> np.ndarray:
        return self._value.copy()

    def assign(self, value: Any) -> Scalar:
        self._value[...] = value
        return self

    def assign_add(self, delta: Any) -> Scalar:
        self._value[...] = self._value + delta
        return self

    def __int__(self) -> int:
        return int(self._value)

    def __index__(self) -> int:
        return int(self._value)

    def __float__(self) -> float:
        return float(self._value)

    def __repr__(self) -> str:
        return f"Scalar({self.value!r}, dtype={self.dtype.name})"


def _leaves(objects: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(name, leaf)`` pairs, names joined with ``/`` (``params/0``), in a fixed order."""
    found: list[tuple[str, Any]] = []

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, Mapping):
            for key in obj:
                if not isinstance(key, str) or "/" in key or not key:
                    raise TypeError(f"checkpoint names must be non-empty strings without "
                                    f"'/', got {key!r} in {name or 'the objects'}")
            for key in sorted(obj):
                visit(f"{name}/{key}" if name else key, obj[key])
        elif isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj):
                visit(f"{name}/{i}", item)
        elif _kind(obj) is None:
            raise TypeError(
                f"cannot checkpoint {name!r}: a {type(obj).__name__} ({obj!r:.60}); give an "
                f"object with numpy() and assign() (an mpistrat Variable), a NumPy array, a "
                f"torch.Tensor, a random generator (numpy.random.Generator, RandomState, "
                f"random.Random, torch.Generator), an object with state_dict() and "
                f"load_state_dict() (a torch module or optimizer), or wrap numbers in "
                f"mpistrat.checkpoint.Scalar so restore() can update them in place")
        else:
            found.append((name, obj))

    visit("", dict(objects))
    return found


def _is_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.Tensor`` (without importing torch: one can only be
    where torch is imported already)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, getattr(torch, "Tensor", ()))


def _torch() -> Any:
    """:mod:`mpistrat.checkpoint._torch`, imported once a torch object is seen."""
    from . import _torch as module
    return module


def _kind(obj: Any) -> str | None:
    if isinstance(obj, np.ndarray):
        return "array"
    if _random.is_generator(obj):
        return "generator"
    if _is_tensor(obj):
        return "tensor"
    if callable(getattr(obj, "numpy", None)) and callable(getattr(obj, "assign", None)):
        return "variable"
    if callable(getattr(obj, "state_dict", None)) and \
            callable(getattr(obj, "load_state_dict", None)) and "torch" in sys.modules:
        return "stateful"  # (torch's objects: where torch is imported already)
    return None


def _value(obj: Any) -> np.ndarray:
    """A value leaf's value (array, tensor, variable), as NumPy (maybe a view)."""
    if isinstance(obj, np.ndarray):
        return obj
    if _is_tensor(obj):
        return _torch().host_value(obj)
    return np.asarray(obj.numpy())


def _assign(obj: Any, value: np.ndarray) -> None:
    """Restore a value leaf in place."""
    if isinstance(obj, np.ndarray):
        obj[...] = value
    elif _is_tensor(obj):
        _torch().assign(obj, value)
    else:
        obj.assign(value)


def _describe(obj: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype name, shape) of a leaf without copying when it says them itself."""
    if _is_tensor(obj):
        return _torch().describe(obj)  # type: ignore[no-any-return]
    dtype, shape = getattr(obj, "dtype", None), getattr(obj, "shape", None)
    if dtype is None or shape is None:
        value = np.asarray(obj.numpy())
        dtype, shape = value.dtype, value.shape
    return np.dtype(dtype).name, tuple(int(n) for n in shape)


class Checkpoint:
    """Named training state, saved by the chief and restored on every rank.

    Args:
        comm: the communicator of the job (default ``COMM_WORLD``; on the coordinator of
            a ``ParameterServerStrategy``, ``COMM_SELF``: it alone saves and restores).
        is_chief: whether this rank writes (exactly one rank must say True); default:
            rank 0 of ``comm``. ``comm`` and ``is_chief`` are therefore not object names.
        **objects: the state (see the module docstring).

    Attributes:
        save_counter: the number of this state's newest numbered save (restored with it);
            the next :meth:`save` writes a higher one.
    """

    def __init__(self, comm: Comm | None = None, is_chief: bool | None = None,
                 **objects: Any) -> None:
        if not objects:
            raise ValueError("Checkpoint needs the objects to save as keyword arguments, e.g. "
                             "Checkpoint(weights=w, step=mpistrat.checkpoint.Scalar(0))")
        self._leaves = _leaves(objects)
        self._comm = comm
        self._is_chief = is_chief
        self._chief: int | None = None
        self.save_counter = 0

    @property
    def comm(self) -> Any:
        return state_comm() if self._comm is None else self._comm

    def _signature(self) -> str:
        parts = []
        for name, obj in self._leaves:
            kind = _kind(obj)
            if kind == "generator":
                parts.append(f"{name}:generator:{_random.family(obj)}")
            elif kind == "stateful":
                parts.append(f"{name}:stateful:{_torch().signature(obj)}")
            else:
                dtype, shape = _describe(obj)
                parts.append(f"{name}:{dtype}{list(shape)}")
        return ";".join(parts)

    def _agree(self, what: str, extra: str) -> int:
        """Agree that every rank has the same state and call; return the chief's rank."""
        comm = self.comm
        signature = error = None
        try:
            signature = f"{self._signature()} | {extra}"
        except Exception as exc:  # noqa: BLE001 - a leaf that fails on one rank fails all
            error = exc
        agree(comm, signature, error, what,
              "the same objects (names, dtypes, shapes) and the same path")
        if self._chief is None:
            mine = (comm.Get_rank() == 0) if self._is_chief is None else bool(self._is_chief)
            chiefs = [r for r, flag in enumerate(comm.allgather(mine)) if flag]
            if len(chiefs) != 1:
                raise TopologyError(
                    f"Checkpoint needs exactly one chief rank (is_chief=True), got "
                    f"{len(chiefs)}: ranks {chiefs}; pass is_chief=resolver.is_chief (True on "
                    f"one rank) or leave it out for rank 0")
            self._chief = chiefs[0]
        return self._chief

    def save(self, file_prefix: str | os.PathLike[str]) -> str:
        """Write the state to ``{file_prefix}-{N}``; collective. Returns the path (without
        suffix).

        N is one more than both :attr:`save_counter` and the highest N of any
        ``file_prefix-N`` checkpoint already on disk (the chief looks, holding the
        directory's lock), so a save never replaces an existing checkpoint and a new run
        in the directory of an older one continues its numbering. ``save_counter``
        becomes N.
        """
        return self._save("Checkpoint.save", os.fspath(file_prefix), numbered=True)

    def write(self, path: str | os.PathLike[str]) -> str:
        """Write the state to exactly ``path`` (``path.json`` and its data file);
        collective. An existing checkpoint at ``path`` is replaced atomically: until the
        new manifest is in place, the old one stays and restores.

        Returns:
            ``path``, once the files are durable.

        Raises:
            OSError: the chief could not write (the same error on every rank).
        """
        return self._save("Checkpoint.write", os.fspath(path), numbered=False)

    def _save(self, what: str, target: str, numbered: bool,
              after: Callable[[str], None] | None = None) -> str:
        """Save to ``target`` (``target-N`` when ``numbered``); the chief writes while it
        holds the directory's lock, then runs ``after(path)`` (pruning) under it too.
        ``after``'s failure is a warning on the chief: the checkpoint is saved. Traced
        as a span ``checkpoint save`` (the bytes written, on the chief)."""
        t = recorder.begin()
        if not t:
            return self._write_state(what, target, numbered, after, None)
        written: list[int] = []
        path = target
        try:
            path = self._write_state(what, target, numbered, after, written)
            return path
        finally:
            recorder.end(t, "checkpoint save", recorder.CHECKPOINT,
                         {"path": path, "call": what,
                          **({"bytes": written[0]} if written else {})})

    def _write_state(self, what: str, target: str, numbered: bool,
                     after: Callable[[str], None] | None, written: list[int] | None) -> str:
        comm = self.comm
        chief = self._agree(what, f"{what} {target}")
        counter = self.save_counter
        self._gather(chief)

        def work() -> tuple[str, int, str | None]:
            arrays, entries = self._collect()
            if written is not None:  # (traced: the bytes written)
                written.append(sum(a.nbytes for a in arrays.values()))
            directory = os.path.dirname(target) or "."
            os.makedirs(directory, exist_ok=True)
            with _files.lock(directory):
                if numbered:
                    number = max(counter, _files.highest_number(
                        directory, os.path.basename(target))) + 1
                    path = f"{target}-{number}"
                else:
                    number, path = counter, target
                _files.write(path, arrays, {
                    "save_counter": number, "entries": entries,
                    "world_size": comm.Get_size(),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
                note = None
                if after is not None:
                    try:
                        after(path)
                    except Exception as exc:  # noqa: BLE001 - the save itself succeeded
                        note = f"{type(exc).__name__}: {exc}"
            return path, number, note

        shown = f"{target}-N" if numbered else target

        def failure(exc: Exception) -> tuple[type[Exception], str]:
            # the chief's own errors say their fix (the lock's TimeoutError too); an error
            # of the file system gets the usual one
            bare = isinstance(exc, OSError) and not isinstance(exc, TimeoutError)
            hint = "; check the directory's space and permissions" if bare else ""
            return OSError, (f"saving the checkpoint {shown!r} failed on the chief (rank "
                             f"{chief}): {type(exc).__name__}: {exc}{hint}")

        path, number, note = _on_chief(comm, chief, work, failure)
        self.save_counter = number
        if note is not None and comm.Get_rank() == chief:
            warnings.warn(f"saved {path}, but could not delete old checkpoints in "
                          f"{os.path.dirname(path) or '.'}: {note}", RuntimeWarning,
                          stacklevel=3)
        return path

    def _gather(self, rank: int) -> None:
        """Collective: the stateful leaves that hold their state in shares (a
        ZeroRedundancyOptimizer) gather it on ``rank``, so that its ``state_dict()``
        works there. Every rank calls it at the same point (a save, a snapshot)."""
        for _, obj in self._leaves:
            if _kind(obj) == "stateful" and _torch().needs_gather(obj):
                _torch().gather(obj, rank)

    def _collect(self) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
        arrays: dict[str, np.ndarray] = {}
        entries: list[dict[str, Any]] = []
        for i, (name, obj) in enumerate(self._leaves):
            kind = _kind(obj)
            if kind == "generator":
                entries.append({"name": name, "kind": kind,
                                "state": _random.get_state(obj)})
                continue
            if kind == "stateful":
                tree, parts = _torch().expand(obj, name)
                described = []
                for j, part in enumerate(parts):
                    key = f"a{i}_{j}"
                    arrays[key] = _storable(name, np.array(part, copy=True))
                    described.append({"key": key, "dtype": arrays[key].dtype.name,
                                      "shape": list(arrays[key].shape)})
                entries.append({"name": name, "kind": kind, "tree": tree,
                                "arrays": described})
                continue
            value = _storable(name, np.array(_value(obj), copy=True))
            key = f"a{i}"
            arrays[key] = value
            entries.append({"name": name, "kind": kind, "key": key, "dtype": value.dtype.name,
                            "shape": list(value.shape)})
        return arrays, entries

    def restore(self, save_path: str | os.PathLike[str] | None) -> str | None:
        """Read the checkpoint at ``save_path`` into the objects, on every rank; collective.

        ``None`` (what ``latest_checkpoint`` gives when there is none) restores nothing,
        so ``ckpt.restore(latest_checkpoint(dir))`` starts fresh or resumes.

        The chief reads and checks everything — the manifest field by field, the data's
        size and checksum, every member's dtype and shape against the manifest, the
        manifest against the objects — and broadcasts its verdict before any data moves:
        a bad checkpoint is the same error on every rank, and no object has changed.

        Returns:
            ``save_path``.

        Raises:
            CheckpointNotFoundError: no complete checkpoint there (on every rank).
            CheckpointCorruptError: the files do not match their manifest, or the
                manifest is not one mpistrat wrote (on every rank).
            ValueError: the checkpoint holds other names, dtypes or shapes than the
                objects (on every rank).
        """
        t = recorder.begin()
        try:
            return self._restore(save_path)
        finally:
            if t:
                recorder.end(t, "checkpoint restore", recorder.CHECKPOINT,
                             {"path": os.fspath(save_path) if save_path is not None
                              else None})

    def _restore(self, save_path: str | os.PathLike[str] | None) -> str | None:
        comm = self.comm
        chief = self._agree("Checkpoint.restore", f"restore {save_path}")
        if save_path is None:
            return None
        path = os.fspath(save_path)
        values: list[np.ndarray] = []

        def work() -> tuple[list[tuple[Any, ...]], int]:
            manifest, arrays = _files.read(path)
            plan, found = self._plan(manifest, arrays, path)
            values.extend(found)
            return plan, manifest["save_counter"]

        def failure(exc: Exception) -> tuple[type[Exception], str]:
            where = f" (read on the chief, rank {chief})"
            for known in (CheckpointNotFoundError, CheckpointCorruptError, ValueError):
                if isinstance(exc, known):
                    return known, f"{exc}{where}"
            return CheckpointCorruptError, (
                f"the checkpoint {path!r} cannot be restored ({type(exc).__name__}: {exc}); "
                f"{_files._FIX}{where}")

        plan, counter = _on_chief(comm, chief, work, failure)
        rank, size = comm.Get_rank(), comm.Get_size()
        chief_values = iter(values)

        def receive(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
            if rank == chief:
                buffer = next(chief_values)
            else:
                buffer = np.empty(shape, dtype=_parse_dtype(dtype))
            if buffer.nbytes and size > 1:
                comm.Bcast(buffer.reshape(-1).view(np.uint8), root=chief)
            return buffer

        received: list[Any] = []
        for step in plan:
            if step[0] == "generator":
                received.append(None)
            elif step[0] == "stateful":
                received.append([receive(d, s) for d, s in step[2]])
            else:
                received.append(receive(step[1], step[2]))
        # every collective is done: an object that refuses its value fails on its own rank
        for (_, obj), step, value in zip(self._leaves, plan, received):
            if step[0] == "generator":
                _random.set_state(obj, step[1])
            elif step[0] == "stateful":
                _torch().load(obj, step[1], value)
            else:
                _assign(obj, value)
        self.save_counter = counter
        return path

    def _plan(self, manifest: dict[str, Any], arrays: dict[str, np.ndarray],
              path: str) -> tuple[list[tuple[Any, ...]], list[np.ndarray]]:
        """On the chief: check the entries and the data (CheckpointCorruptError), then pair
        them with the objects (ValueError). Returns, in the objects' order, the plan every
        rank follows — ``("value", dtype name, shape)`` or ``("generator", state)`` — and
        the chief's arrays for the value steps, C-contiguous in the manifest's dtype."""
        entries = _check_entries(manifest["entries"], arrays, path + ".json")
        names = [name for name, _ in self._leaves]
        missing = [n for n in names if n not in entries]
        extra = [n for n in entries if n not in names]
        if missing or extra:
            raise ValueError(
                f"the checkpoint {path!r} does not hold these objects: missing {missing}, "
                f"unexpected {extra}; restore it into the objects it was saved from (same "
                f"keyword names and nesting)")
        plan: list[tuple[Any, ...]] = []
        values = []
        for name, obj in self._leaves:
            entry = entries[name]
            kind = _kind(obj)
            if (kind == "generator") != (entry.kind == "generator"):
                raise ValueError(f"checkpoint entry {name!r} is a {entry.kind}, the object "
                                 f"is a {type(obj).__name__}; restore it into the objects it "
                                 f"was saved from")
            if (kind == "stateful") != (entry.kind == "stateful"):
                raise ValueError(f"checkpoint entry {name!r} is a {entry.kind}, the object "
                                 f"is a {type(obj).__name__}; restore it into the objects it "
                                 f"was saved from")
            if kind == "stateful":
                assert entry.parts is not None
                parts = entry.parts
                _torch().check_fits(obj, name, _torch().decode(
                    entry.tree, len(parts), lambda j: parts[j]))
                plan.append(("stateful", entry.tree,
                             [(p.dtype.name, tuple(p.shape)) for p in parts]))
                values.extend(parts)
                continue
            if kind == "generator":
                assert entry.state is not None
                why = _random.mismatch(obj, entry.state)
                if why is not None:
                    raise ValueError(f"checkpoint entry {name!r} {why}")
                plan.append(("generator", entry.state))
                continue
            assert entry.dtype is not None and entry.shape is not None and entry.value is not None
            dtype, shape = _describe(obj)
            if dtype != entry.dtype.name or shape != entry.shape:
                raise ValueError(
                    f"checkpoint entry {name!r} holds {entry.dtype.name} of shape "
                    f"{entry.shape}, the object is {dtype} of shape {shape}; build the model "
                    f"with the shapes it was saved with")
            plan.append(("value", entry.dtype.name, entry.shape))
            values.append(entry.value)
        return plan, values


def _storable(name: str, value: np.ndarray) -> np.ndarray:
    """``value`` as a checkpoint stores it (native byte order, a dtype it can name)."""
    if value.dtype.hasobject:
        raise TypeError(f"cannot checkpoint {name!r}: it holds Python objects "
                        f"(dtype object); use numeric arrays")
    if value.dtype.byteorder not in "=|":  # stored native, so the name says it all
        value = value.astype(value.dtype.newbyteorder("="))
    try:
        _parse_dtype(value.dtype.name)
    except ValueError:
        raise TypeError(
            f"cannot checkpoint {name!r}: its dtype {value.dtype} has no name a "
            f"manifest can hold and restore (strings, bytes and structured arrays "
            f"have none); use {_DTYPES}") from None
    return value


def _on_chief(comm: Comm, chief: int, work: Callable[[], Any],
              failure: Callable[[Exception], tuple[type[Exception], str]]) -> Any:
    """``work()`` run on the chief alone; its result on every rank.

    Whatever it raises (any ``Exception``), ``failure`` turns on the chief into an error
    class and message, which are broadcast, and every rank raises that same error — never
    the chief alone while the others wait for it in a broadcast."""
    answer: Any = None
    original: Exception | None = None
    if comm.Get_rank() == chief:
        try:
            answer = ("ok", work())
        except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
            original = exc
            try:
                cls, message = failure(exc)
            except Exception:  # noqa: BLE001
                cls, message = RuntimeError, f"{type(exc).__name__}: {exc}"
            answer = ("error", cls, message)
    answer = comm.bcast(answer, root=chief)
    if answer[0] == "ok":
        return answer[1]
    raise answer[1](answer[2]) from original


class _Entry(NamedTuple):
    kind: str
    dtype: np.dtype | None = None
    shape: tuple[int, ...] | None = None
    value: np.ndarray | None = None  # the member, in ``dtype``, C-contiguous
    state: dict[str, Any] | None = None
    tree: Any = None  # a stateful object's state_dict (mpistrat.checkpoint._torch)
    parts: list[np.ndarray] | None = None  # ... and its arrays, checked like values


_KINDS = ("array", "variable", "generator", "tensor", "stateful")
_DTYPES = ("numeric arrays (bool, integers, floats, complex, datetime64, timedelta64) or "
           "ml_dtypes' (bfloat16, float8_*, int4, ...)")


def _check_entries(raw: list[Any], arrays: dict[str, np.ndarray],
                   record: str) -> dict[str, _Entry]:
    """The manifest's entries by name, each checked as untrusted input and against its
    member of the data file.

    Raises:
        CheckpointCorruptError: naming the entry, the bad value and what was expected.
    """
    found: dict[str, _Entry] = {}

    def bad(i: int, field: str, value: Any, expected: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"the manifest {record}: entry {i} has {field} {_files._show(value)}, expected "
            f"{expected}; it was damaged or not written by mpistrat: {_files._FIX}")

    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise bad(i, "type", type(entry).__name__, "an object with name, kind, ...")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise bad(i, '"name"', name, "a non-empty string")
        if name in found:
            raise bad(i, '"name"', name, "a name no other entry has")
        kind = entry.get("kind")
        if kind not in _KINDS:
            raise bad(i, '"kind"', kind, f"one of {list(_KINDS)}")
        if kind == "generator":
            found[name] = _Entry(kind, state=_random.check_state(
                entry.get("state"), lambda v, e: bad(i, '"state"', v, e)))
            continue
        if kind == "stateful":
            described = entry.get("arrays")
            if not isinstance(described, list):
                raise bad(i, '"arrays"', described, "a list of arrays")
            parts = []
            for j, part in enumerate(described):
                if not isinstance(part, dict):
                    raise bad(i, f'"arrays" item {j}', part, "an object with key, dtype, shape")
                parts.append(_checked_member(
                    part, arrays, record, f"{name}[{j}]",
                    lambda field, value, expected: bad(i, f'array {j}\'s {field}', value,
                                                       expected))[2])
            try:
                # (without torch imported no object is stateful: the entry cannot be
                # restored, and _plan says so before its tree is read)
                if "torch" in sys.modules:
                    _torch().decode(entry.get("tree"), len(parts), lambda j: None)
            except ValueError as exc:
                raise bad(i, '"tree"', entry.get("tree"), f"a state_dict's tree ({exc})") \
                    from None
            found[name] = _Entry(kind, tree=entry.get("tree"), parts=parts)
            continue
        dtype, shape, value = _checked_member(
            entry, arrays, record, name,
            lambda field, value, expected: bad(i, field, value, expected))
        found[name] = _Entry(kind, dtype, shape, value)
    return found


def _checked_member(entry: dict[str, Any], arrays: dict[str, np.ndarray], record: str,
                    name: str, bad: Callable[[str, Any, str], Exception]
                    ) -> tuple[np.dtype, tuple[int, ...], np.ndarray]:
    """The member an entry (``key``, ``dtype``, ``shape``) describes, checked."""
    key = entry.get("key")
    if not isinstance(key, str):
        raise bad('"key"', key, "the name of a member of the data file")
    try:
        dtype = _parse_dtype(entry.get("dtype"))
    except ValueError as exc:
        raise bad('"dtype"', entry.get("dtype"), str(exc)) from None
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_files._is_int(n, 0) for n in shape):
        raise bad('"shape"', shape, "a list of integers >= 0")
    if key not in arrays:
        raise CheckpointCorruptError(
            f"the data file of {record} has no member {key!r} (entry {name!r}); its "
            f"members are {sorted(arrays)[:10]}: it was damaged or not written with this "
            f"manifest; {_files._FIX}")
    value = _member(arrays[key], dtype, tuple(shape), f"member {key!r} (entry {name!r}) "
                                                      f"of the data file of {record}")
    return dtype, tuple(shape), value


def _member(member: np.ndarray, dtype: np.dtype, shape: tuple[int, ...],
            what: str) -> np.ndarray:
    """The member as the manifest describes it, never by reinterpreting other bytes: the
    same dtype, the same dtype in the other byte order (converted), or for ml_dtypes'
    types the raw void of their size that ``np.load`` gives for them."""
    mine = member.dtype
    if mine.shape != () or mine.names is not None:
        value = None
    elif mine == dtype:
        value = member
    elif mine.byteorder in "<>" and mine.newbyteorder("=") == dtype:
        value = member.astype(dtype)
    elif mine.kind == "V" and _is_ml_dtype(dtype) and mine.itemsize == dtype.itemsize:
        value = member.view(dtype)  # bfloat16 and friends are stored as void of their size
    else:
        value = None
    if value is None:
        raise CheckpointCorruptError(
            f"{what} holds {mine}, the manifest says {dtype.name}: restoring it would "
            f"reinterpret its bytes; {_files._FIX}")
    if member.shape != shape:
        raise CheckpointCorruptError(
            f"{what} has shape {member.shape}, the manifest says {shape} "
            f"({math.prod(shape) * dtype.itemsize} bytes, the member has {member.nbytes}); "
            f"{_files._FIX}")
    return np.asarray(value, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)



def _is_ml_dtype(dtype: np.dtype) -> bool:
    return dtype.type.__module__.split(".")[0] == "ml_dtypes"


_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]{0,40}(\[[0-9a-z]{1,8}\])?")


def _parse_dtype(name: Any) -> np.dtype:
    """The dtype a manifest names: NumPy's numeric types by their canonical name, or one
    of ml_dtypes' (bfloat16 and friends, which register their names on import).

    Raises:
        ValueError: what was expected instead.
    """
    if not isinstance(name, str) or not _DTYPE_NAME.fullmatch(name):
        raise ValueError("a dtype name such as 'float32'")
    try:
        dtype = np.dtype(name)
    except Exception:  # noqa: BLE001 - NumPy raises TypeError, sometimes others
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError(f"a NumPy dtype name ({name!r} is none; if it is one of "
                             f"ml_dtypes' types: pip install ml_dtypes)") from None
        found = getattr(ml_dtypes, name, None)
        if not (isinstance(found, type) and issubclass(found, np.generic)):
            raise ValueError("a NumPy or ml_dtypes dtype name") from None
        dtype = np.dtype(found)
    if not (dtype.kind in "biufcmM" or _is_ml_dtype(dtype)) or dtype.names is not None \
            or dtype.shape != () or dtype.name != name:
        raise ValueError(f"the canonical name of one of {_DTYPES}")
    return dtype

