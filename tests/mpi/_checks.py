"""Checks shared by the MPI algorithm tests: dtypes, tolerances, result comparison, and
the final all-ranks agreement on result hashes (one collective, then assert)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _eps(dtype: np.dtype) -> float:
    if dtype.kind in "iu":
        return 0.0
    if dtype.name == "bfloat16":
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).eps)
    return float(np.finfo(dtype).eps)


def problem(result, ref, tol, dtype, label: str) -> str | None:
    """What is wrong with ``result`` against the float64 reference, or None."""
    if not isinstance(result, np.ndarray):
        return f"{label}: got a {type(result).__name__}, expected an ndarray"
    if result.dtype != dtype:
        return f"{label}: dtype {result.dtype}, expected {dtype}"
    if result.shape != ref.shape:
        return f"{label}: shape {result.shape}, expected {ref.shape}"
    got = result.astype(np.float64)
    bad = ~(np.abs(got - ref) <= tol)
    if bad.any():
        i = np.unravel_index(int(np.flatnonzero(bad)[0]), ref.shape)
        return (f"{label}: {int(bad.sum())} of {ref.size} elements wrong, first at {i}: "
                f"got {got[i]!r}, expected {ref[i]!r} (tolerance {tol[i]:.3g})")
    return None


def digest(array: np.ndarray) -> str:
    """SHA-256 of dtype, shape and bytes (never Python's per-process salted hash())."""
    array = np.asarray(array)
    header = f"{array.dtype.str}{array.shape}".encode()
    return hashlib.sha256(header + np.ascontiguousarray(array).tobytes()).hexdigest()


def finish(comm, problems: list[str], digests: list[tuple[str, str]]) -> None:
    """One allgather of every rank's result hashes, then assert."""
    everyone = comm.allgather(digests)
    for rank, theirs in enumerate(everyone):
        if theirs != digests:
            differ = [label for (label, mine), (_, other) in zip(digests, theirs)
                      if mine != other]
            problems.append(f"results differ between rank {comm.rank} and rank {rank} of "
                            f"{comm.size}: {differ[:3] or 'different number of results'}")
            break
    assert not problems, "\n".join(problems[:20])


def spy_algorithms(monkeypatch) -> list[str]:
    """Record the name of every algorithm ``mpistrat.dispatch.run`` runs (still runs it)."""
    from mpistrat import dispatch

    seen: list[str] = []
    real = dispatch.run

    def spy(name, *args, **kwargs):
        seen.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(dispatch, "run", spy)
    return seen
