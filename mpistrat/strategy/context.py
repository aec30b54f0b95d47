"""Which strategy is current, and whether code runs per replica or across replicas.

TensorFlow's rules (``tf.distribute``): outside any scope the *default strategy* is
current, in its default replica context (replica 0 of 1). ``with s.scope()`` makes ``s``
current in cross-replica context; ``s.run(fn)`` calls ``fn`` in a replica context of
``s``; a ``merge_call`` inside it runs its function in cross-replica context again. At any
point exactly one of "a replica context is current" and "in cross-replica context" holds.

The state is a stack per thread (replica threads start with their own replica context),
under a process-wide base that :func:`experimental_set_strategy` replaces.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = ["get_strategy", "has_strategy", "in_cross_replica_context", "get_replica_context",
           "get_cross_replica_context", "experimental_set_strategy", "set_launcher_strategy"]


@dataclass(frozen=True)
class _Entry:
    strategy: Any
    replica_context: Any  # None: cross-replica context of ``strategy``
    yields: bool = False  # set by the launcher: another strategy's scope() may open inside


_local = threading.local()
_base: list[_Entry] = []  # experimental_set_strategy's entry, process-wide


def _stack() -> list[_Entry]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _current() -> _Entry:
    stack = getattr(_local, "stack", None)
    if stack:
        return stack[-1]
    if _base:
        return _base[-1]
    if not _DEFAULT_ENTRY:  # (made once: every read of a variable outside a scope asks)
        default = _default_strategy()
        _DEFAULT_ENTRY.append(_Entry(default, default._default_replica_context))
    return _DEFAULT_ENTRY[0]


@contextmanager
def _entered(strategy: Any, replica_context: Any) -> Iterator[None]:
    """Push ``(strategy, replica_context)`` for the duration of a ``with`` block."""
    stack = _stack()
    stack.append(_Entry(strategy, replica_context))
    try:
        yield
    finally:
        stack.pop()


def _start_thread(strategy: Any, replica_context: Any) -> None:
    """A replica thread's stack starts in its replica context."""
    _local.stack = [_Entry(strategy, replica_context)]


def get_strategy() -> Any:
    """The current strategy: the innermost ``scope()``/``run`` one, else the one set by
    :func:`experimental_set_strategy`, else the default (single-replica) strategy."""
    return _current().strategy


def has_strategy() -> bool:
    """True when a strategy other than the default one is current."""
    return not getattr(_current().strategy, "_is_default", False)


def get_replica_context() -> Any:
    """The current :class:`ReplicaContext`, or None in cross-replica context (inside a
    ``scope()``, or inside a ``merge_call`` function). Outside any strategy: the default
    strategy's replica context (replica 0 of 1)."""
    return _current().replica_context


def in_cross_replica_context() -> bool:
    """True inside a strategy's ``scope()`` (or a ``merge_call`` function), outside ``run``."""
    return _current().replica_context is None


def get_cross_replica_context() -> Any:
    """The current strategy in cross-replica context, else None."""
    entry = _current()
    return entry.strategy if entry.replica_context is None else None


def experimental_set_strategy(strategy: Any) -> None:
    """Make ``strategy`` current for the whole process, like entering its ``scope()``
    without a ``with`` block (None goes back to the default strategy).

    Raises:
        RuntimeError: called inside a ``scope()`` or ``run``: leave it first.
    """
    if _stack():
        raise RuntimeError(
            "experimental_set_strategy cannot be called inside a strategy's scope() or "
            "run(); call it at the top level of the program"
        )
    if strategy is not None and not isinstance(strategy, _installed.strategy_type):
        raise TypeError(f"experimental_set_strategy takes a Strategy or None, got "
                        f"{type(strategy).__name__}")
    _base.clear()
    if strategy is not None and not getattr(strategy, "_is_default", False):
        _base.append(_Entry(strategy, None))


def set_launcher_strategy(strategy: Any) -> None:
    """What ``mpistrat run`` does with the strategy it makes from its options: like
    :func:`experimental_set_strategy`, except that a script which builds its own strategy
    and enters its ``scope()`` (as TF scripts do) gets that one inside the scope instead of
    TF's "mixing strategies" error, since the script never asked for the launcher's."""
    experimental_set_strategy(strategy)
    if _base:
        _base[0] = _Entry(_base[0].strategy, None, yields=True)


class _installed:
    """The classes of ``strategy.base``, which sits above this module: it installs them
    here when it is imported (importing ``mpistrat.strategy`` always imports it)."""

    strategy_type: type = object
    default_type: Callable[[], Any] | None = None


def install(strategy_type: type, default_type: Callable[[], Any]) -> None:
    """Called once by ``strategy.base``: what a strategy is, and how to make the default one."""
    _installed.strategy_type = strategy_type
    _installed.default_type = default_type


_DEFAULT: list[Any] = []
_DEFAULT_ENTRY: list[_Entry] = []  # the default strategy's, in its replica context


def _default_strategy() -> Any:
    if not _DEFAULT:
        if _installed.default_type is None:
            raise RuntimeError("mpistrat.strategy.base was not imported; import "
                               "mpistrat.strategy before using the strategy context")
        _DEFAULT.append(_installed.default_type())
    return _DEFAULT[0]
