"""Step boundaries, where an elastic job takes its snapshots: the standard library only
(and the trace's recorder, which is too), so that the input pipeline
(:mod:`mpistrat.data`) and the checkpoint manager (:mod:`mpistrat.checkpoint`) meet here
without importing each other.

A step boundary is the moment between two training steps when every rank holds the
same, complete state: the distributed dataset's iterator is asked for global batch ``i``
(so batches ``0 .. i-1`` are trained on, and their updates applied), a torch
``DataLoader`` asks :class:`mpistrat.torch.DistributedBatchSampler` for batch ``i`` (the
one boundary of a torch loop: mpistrat.torch's DistributedDataParallel marks none, so a
step counts once), or the script calls :func:`mpistrat.elastic.step`. With snapshots off
(no elastic job, or no :class:`~mpistrat.checkpoint.CheckpointManager` to take them), a
boundary costs one branch, and one more for the trace (:mod:`mpistrat.trace`), whose
steps it also marks: an input position's boundary as the input's
(:data:`~mpistrat.runtime.recorder.FROM_INPUT`), the script's as the script's. An iterator
that waits for its batch marks the trace's step itself, before the wait (the wait belongs
to the step it feeds), and passes ``traced=True``.

A snapshot copies mpistrat's variables in the background; until it has, the first write
to any of them waits (:func:`before_write`, called by every variable update: one branch
when no copy is in flight).

The input pipeline's position travels the other way: a restored snapshot says which
iterator was at which global batch (:func:`set_resume`), and the first iterator of that
kind started afterwards skips those batches (:func:`take_resume`). Iterators run to
their end since (:func:`iteration_ended`; the last :data:`MAX_FINISHED`) travel along:
after a relaunch, the script starts again at the top of its loop (its epoch counter is
restored too), and an iterator that had ended before the snapshot's one started — the
training pass of an epoch whose evaluation was cut short — skips all its batches, until
the snapshot's own iterator starts.
"""

from __future__ import annotations

from collections.abc import Callable

from ..runtime import recorder

__all__ = ["set_taker", "taker", "step_boundary", "set_resume", "take_resume", "Position",
           "set_fence", "before_write", "iteration_started", "iteration_ended", "finished",
           "MAX_FINISHED", "reset"]

# (what the iterator is, how many global batches it has handed out): None for a boundary
# the script marks itself (mpistrat.elastic.step)
Position = tuple[str, int] | None
_TAKER: list[Callable[[Position], None]] = []
_RESUME: list[tuple[str, int]] = []
MAX_FINISHED = 8  # iterators run to their end that a snapshot remembers (newest last)
_FINISHED: list[tuple[str, int]] = []
_RESUME_FINISHED: list[tuple[str, int]] = []
_FENCE: list[Callable[[], object]] = []


def set_taker(take: Callable[[Position], None] | None) -> None:
    """Call ``take(position)`` at every step boundary from now on (None: stop)."""
    _TAKER[:] = [take] if take is not None else []


def taker() -> Callable[[Position], None] | None:
    """What is called at a step boundary, or None."""
    return _TAKER[0] if _TAKER else None


def step_boundary(position: Position, *, traced: bool = False) -> None:
    """A step boundary at ``position`` (see the module docstring); ``traced``: the caller
    has marked the trace's step already."""
    if not traced:
        recorder.boundary(recorder.FROM_SCRIPT if position is None else recorder.FROM_INPUT)
    if _TAKER:
        _TAKER[0](position)


def set_resume(position: Position,
               finished: tuple[tuple[str, int], ...] | list[tuple[str, int]] = ()) -> None:
    """The restored snapshot's input position and the iterators that had ended before
    it (:func:`finished`): the next :func:`take_resume` of one of those kinds gets its
    batch count (None, (): none)."""
    _RESUME[:] = [position] if position is not None else []
    _RESUME_FINISHED[:] = list(finished)


def take_resume(kind: str) -> int:
    """How many global batches a new iterator of ``kind`` skips: the restored position's
    count the first time one of its kind starts after a restore (then the ended ones are
    forgotten: what follows is new), an ended iterator's whole count if it starts before
    that, else 0."""
    if _RESUME and _RESUME[0][0] == kind:
        _RESUME_FINISHED.clear()
        return _RESUME.pop()[1]
    for i, (ended, count) in enumerate(_RESUME_FINISHED):
        if ended == kind:
            del _RESUME_FINISHED[i]
            return count
    return 0


def iteration_started(kind: str) -> None:
    """An iterator of ``kind`` starts: it is no longer one that ended."""
    if _FINISHED:
        _FINISHED[:] = [item for item in _FINISHED if item[0] != kind]


def iteration_ended(kind: str, count: int) -> None:
    """An iterator of ``kind`` handed out its last global batch (``count`` in all)."""
    _FINISHED[:] = [item for item in _FINISHED if item[0] != kind][-(MAX_FINISHED - 1):]
    _FINISHED.append((kind, count))


def finished() -> tuple[tuple[str, int], ...]:
    """The iterators run to their end lately (oldest first), for a snapshot."""
    return tuple(_FINISHED)



def set_fence(wait: Callable[[], object] | None) -> None:
    """Make :func:`before_write` call ``wait()`` until it is set to None again."""
    _FENCE[:] = [wait] if wait is not None else []


def before_write() -> None:
    """About to change a variable: wait for a snapshot that still copies it (traced as
    ``snapshot fence wait``)."""
    if _FENCE:
        fence = _FENCE[:1]
        if fence:
            t = recorder.begin()
            fence[0]()
            if t:
                recorder.end(t, "snapshot fence wait", recorder.CHECKPOINT)


def reset() -> None:
    """Forget every taker, fence, position and ended iterator (a new start, e.g. between
    tests in one process)."""
    for state in (_TAKER, _RESUME, _FINISHED, _RESUME_FINISHED, _FENCE):
        state.clear()
