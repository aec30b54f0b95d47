"""What iterating a distributed input gives: a :class:`DistributedIterator` (TF's
``tf.distribute.DistributedIterator``) and the :class:`Optional` its
``get_next_as_optional`` returns.

The end of the input is agreed across the workers before it is seen (see
:mod:`.distribute`): every worker takes the same number of steps, a worker whose data ran
out gets empty batches until all have, and then every worker sees the end at the same
step. So ``get_next_as_optional().has_value()`` is False on every worker together, as in
TF, and a loop that stops there never leaves another worker waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..errors import OutOfRangeError

__all__ = ["DistributedIterator", "Optional"]

_END = object()


class Optional:
    """A value that may be absent (TF's ``tf.experimental.Optional``), as
    :meth:`DistributedIterator.get_next_as_optional` returns it.

    Make one with :meth:`from_value` or :meth:`empty`.
    """

    __slots__ = ("_value", "_has", "_spec")

    def __init__(self, value: Any, has_value: bool, element_spec: Any) -> None:
        self._value = value
        self._has = bool(has_value)
        self._spec = element_spec

    @classmethod
    def from_value(cls, value: Any, element_spec: Any = None) -> Optional:
        """An optional holding ``value``."""
        return cls(value, True, element_spec)

    @classmethod
    def empty(cls, element_spec: Any = None) -> Optional:
        """An optional without a value (``element_spec``: what it would hold)."""
        return cls(None, False, element_spec)

    def has_value(self) -> bool:
        """True when the optional holds a value."""
        return self._has

    def get_value(self) -> Any:
        """The value.

        Raises:
            ValueError: the optional is empty (TF's ``InvalidArgumentError``).
        """
        if not self._has:
            raise ValueError(
                "get_value() on an empty Optional: the distributed input has ended on every "
                "worker; test has_value() first and leave the loop when it is False"
            )
        return self._value

    @property
    def element_spec(self) -> Any:
        """The spec of the value (the iterator's ``element_spec``; None if unknown)."""
        return self._spec

    def __bool__(self) -> bool:
        raise TypeError(
            "an Optional has no truth value; write `if optional.has_value():` (a bare "
            "`if optional:` would be true even when it is empty in TF's graph code)"
        )

    def __repr__(self) -> str:
        return f"Optional({self._value!r})" if self._has else "Optional(empty)"


class DistributedIterator:
    """An iterator over a distributed dataset (``iter(dist_dataset)``): one step of the
    input per call, the same number of steps on every worker.

    Each element is a nest shaped like one element of the input whose leaves hold every
    local replica's part (a ``PerReplica`` with several local replicas). A new
    ``iter(dist_dataset)`` starts a new epoch; ``iter(iterator)`` is the iterator itself.

    Every call that takes a step (``next``, :meth:`get_next`, :meth:`get_next_as_optional`)
    is a collective over the workers (their agreement that one of them still has data), so
    every worker must call them the same number of times.
    """

    def __init__(self, steps: Iterator[Any], element_spec: Callable[[], Any]) -> None:
        self._steps = steps
        self._element_spec = element_spec
        self._ended = False

    def __iter__(self) -> DistributedIterator:
        return self

    def _next(self) -> Any:
        if self._ended:
            return _END
        value = next(self._steps, _END)
        self._ended = value is _END
        return value

    def __next__(self) -> Any:
        value = self._next()
        if value is _END:
            raise StopIteration
        return value

    def get_next(self) -> Any:
        """The next step's per-replica values.

        Raises:
            OutOfRangeError: the input has ended (on every worker at the same step).
        """
        value = self._next()
        if value is _END:
            raise OutOfRangeError(
                "End of sequence: the distributed input has ended on every worker; "
                "start a new epoch with iter(dist_dataset), or use get_next_as_optional() "
                "and stop when has_value() is False"
            )
        return value

    def get_next_as_optional(self) -> Optional:
        """The next step's values as an :class:`Optional`: empty once the input has ended,
        on every worker at the same step (a worker that ran out before the others gets
        empty batches, first dimension 0, until they have too)."""
        value = self._next()
        if value is _END:
            return Optional.empty(self.element_spec)
        return Optional.from_value(value, self.element_spec)

    @property
    def element_spec(self) -> Any:
        """The spec of one replica's part of an element: a nest of ``ArraySpec`` with the
        batch dimension None (None when the input cannot tell)."""
        return self._element_spec()

    def __repr__(self) -> str:
        return f"<DistributedIterator{' (ended)' if self._ended else ''}>"
