"""``Checkpoint``: save the training state from the chief, restore it on every rank.

The objects are named keyword arguments, as in ``tf.train.Checkpoint``; each may be a
dict, list or tuple of further objects. A leaf is anything with ``numpy()`` and
``assign(value)`` (mpistrat's variables, :class:`Scalar`), a NumPy array (restored in
place), or a ``numpy.random.Generator`` (its state is saved, so shuffles resume too).

``save``/``write``/``restore`` are collective: every rank calls them. Saving writes the
chief's values (in synchronous training every rank holds the same), from the chief only,
atomically (see :mod:`mpistrat.checkpoint._files`), and returns once the files are durable
— or raises the chief's error on every rank. Restoring reads on the chief only and
broadcasts: the values are then identical on every rank by construction, ranks need not
share a file system, and a large job does not have every rank read the same file at once.
A missing, torn or mismatching checkpoint raises the same error on every rank.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import TopologyError
from ..runtime._mpi import Comm, mpi, state_comm
from ..runtime.agreement import agree
from . import _files
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
                f"numpy.random.Generator, or wrap numbers in mpistrat.checkpoint.Scalar so "
                f"restore() can update them in place")
        else:
            found.append((name, obj))

    visit("", dict(objects))
    return found


def _kind(obj: Any) -> str | None:
    if isinstance(obj, np.ndarray):
        return "array"
    if isinstance(obj, np.random.Generator):
        return "generator"
    if callable(getattr(obj, "numpy", None)) and callable(getattr(obj, "assign", None)):
        return "variable"
    return None


def _describe(obj: Any) -> tuple[str, tuple[int, ...]]:
    """(dtype name, shape) of a leaf without copying when it says them itself."""
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
        save_counter: how many numbered saves this state has had (restored with it).
    """

    def __init__(self, comm: Comm | None = None, is_chief: bool | None = None, **objects: Any) -> None:
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
                parts.append(f"{name}:generator:{type(obj.bit_generator).__name__}")
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

    def save(self, file_prefix: str) -> str:
        """Write the state to ``{file_prefix}-{N}`` with N = ``save_counter + 1``;
        collective. Returns the path (without suffix)."""
        path = f"{file_prefix}-{self.save_counter + 1}"
        self.save_counter += 1
        try:
            return self.write(path)
        except BaseException:
            self.save_counter -= 1
            raise

    def write(self, path: str) -> str:
        """Write the state to exactly ``path`` (``path.npz`` + ``path.json``); collective.

        Returns:
            ``path``, once the files are durable.

        Raises:
            OSError: the chief could not write (the same error on every rank).
        """
        comm = self.comm
        chief = self._agree("Checkpoint.write", f"write {path}")
        failure = None
        if comm.Get_rank() == chief:
            try:
                arrays, entries = self._collect()
                _files.write(path, arrays, {
                    "save_counter": self.save_counter, "entries": entries,
                    "world_size": comm.Get_size(),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            except (OSError, ValueError, TypeError) as exc:
                failure = (type(exc).__name__, str(exc))
        failure = comm.bcast(failure, root=chief)
        if failure is not None:
            kind, message = failure
            raise OSError(f"saving the checkpoint {path!r} failed on the chief (rank {chief}): "
                          f"{kind}: {message}; check the directory's space and permissions")
        return path

    def _collect(self) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
        arrays: dict[str, np.ndarray] = {}
        entries: list[dict[str, Any]] = []
        for i, (name, obj) in enumerate(self._leaves):
            kind = _kind(obj)
            if kind == "generator":
                entries.append({"name": name, "kind": kind,
                                "state": _jsonable(obj.bit_generator.state)})
                continue
            value = np.array(obj if kind == "array" else obj.numpy(), copy=True)
            if value.dtype.hasobject:
                raise TypeError(f"cannot checkpoint {name!r}: it holds Python objects "
                                f"(dtype object); use numeric arrays")
            key = f"a{i}"
            arrays[key] = value
            entries.append({"name": name, "kind": kind, "key": key, "dtype": value.dtype.name,
                            "shape": list(value.shape)})
        return arrays, entries

    def restore(self, save_path: str | None) -> str | None:
        """Read the checkpoint at ``save_path`` into the objects, on every rank; collective.

        ``None`` (what ``latest_checkpoint`` gives when there is none) restores nothing,
        so ``ckpt.restore(latest_checkpoint(dir))`` starts fresh or resumes.

        Returns:
            ``save_path``.

        Raises:
            CheckpointNotFoundError: no complete checkpoint there (on every rank).
            CheckpointCorruptError: the files do not match their manifest (on every rank).
            ValueError: the checkpoint holds other names, dtypes or shapes than the
                objects (on every rank).
        """
        comm = self.comm
        chief = self._agree("Checkpoint.restore", f"restore {save_path}")
        if save_path is None:
            return None
        header: Any = None
        arrays: dict[str, np.ndarray] = {}
        if comm.Get_rank() == chief:
            try:
                manifest, arrays = _files.read(save_path)
                header = ("ok", manifest)
            except (CheckpointNotFoundError, CheckpointCorruptError) as exc:
                header = (type(exc).__name__, str(exc))
        header = comm.bcast(header, root=chief)
        if header[0] != "ok":
            error = {"CheckpointNotFoundError": CheckpointNotFoundError,
                     "CheckpointCorruptError": CheckpointCorruptError}[header[0]]
            raise error(f"{header[1]} (read on the chief, rank {chief})")
        manifest = header[1]
        plan = self._match(manifest, save_path)
        for (name, obj), entry in plan:
            if entry["kind"] == "generator":
                obj.bit_generator.state = entry["state"]
                continue
            value = arrays.get(entry["key"]) if comm.Get_rank() == chief else None
            value = _broadcast(comm, value, entry, chief)
            if isinstance(obj, np.ndarray):
                obj[...] = value
            else:
                obj.assign(value)
        self.save_counter = int(manifest.get("save_counter", 0))
        return save_path

    def _match(self, manifest: dict[str, Any], path: str) -> list[tuple[tuple[str, Any], dict]]:
        """Pair each object with its entry; the same answer on every rank (the objects were
        agreed, the manifest broadcast)."""
        entries = {e["name"]: e for e in manifest.get("entries", [])}
        names = [name for name, _ in self._leaves]
        missing = [n for n in names if n not in entries]
        extra = [n for n in entries if n not in names]
        if missing or extra:
            raise ValueError(
                f"the checkpoint {path!r} does not hold these objects: missing {missing}, "
                f"unexpected {extra}; restore it into the objects it was saved from (same "
                f"keyword names and nesting)")
        plan = []
        for name, obj in self._leaves:
            entry = entries[name]
            kind = _kind(obj)
            if (kind == "generator") != (entry["kind"] == "generator"):
                raise ValueError(f"checkpoint entry {name!r} is a {entry['kind']}, the object "
                                 f"is a {type(obj).__name__}")
            if kind == "generator" and entry["state"].get("bit_generator") != \
                    type(obj.bit_generator).__name__:
                raise ValueError(f"checkpoint entry {name!r} holds a "
                                 f"{entry['state'].get('bit_generator')} state, the object "
                                 f"uses {type(obj.bit_generator).__name__}")
            if kind != "generator":
                dtype, shape = _describe(obj)
                if dtype != entry["dtype"] or list(shape) != entry["shape"]:
                    raise ValueError(
                        f"checkpoint entry {name!r} holds {entry['dtype']} of shape "
                        f"{tuple(entry['shape'])}, the object is {dtype} of shape {shape}; "
                        f"build the model with the shapes it was saved with")
            plan.append(((name, obj), entry))
        return plan


def _broadcast(comm: Comm, value: np.ndarray | None, entry: dict[str, Any], root: int) -> np.ndarray:
    """The chief's array on every rank (moved as bytes, so any dtype travels)."""
    if value is None:
        out = np.empty(tuple(entry["shape"]), dtype=_dtype(entry["dtype"]))
    else:
        out = np.asarray(value, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
        if out.dtype.name != entry["dtype"]:  # bfloat16 and friends come back as void
            out = out.view(_dtype(entry["dtype"]))
        out = out.reshape(tuple(entry["shape"]))
    if out.nbytes and comm.Get_size() > 1:
        comm.Bcast(out.reshape(-1).view(np.uint8), root=root)
    return out


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16 and friends register their names on import

        return np.dtype(getattr(ml_dtypes, name))


def _jsonable(state: Any) -> Any:
    """A bit generator's state as JSON (its big integers and arrays included)."""
    return json.loads(json.dumps(state, default=lambda o: o.tolist()))

