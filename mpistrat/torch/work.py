"""The ``Work`` objects the ``"mpistrat"`` backend's calls return: :class:`Done` for a
collective (every one has finished by the time it returns), :class:`Work` for a send or
a receive, finished by ``wait()``, ``is_completed()`` or its future."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeoutError
from ..runtime import recorder
from ..runtime._mpi import mpi

__all__ = ["Work", "Done", "timeout_seconds", "DEFAULT_TIMEOUT"]


class Work(dist._Work):
    """The work of a send or a receive: an MPI request that ``wait()``,
    ``is_completed()`` or a waiter on ``get_future()`` completes. Posted while tracing
    (``traced``: the post's span args), a ``wait()`` that finds it incomplete is recorded
    as the span ``torch.distributed.send wait`` (or ``recv wait``)."""

    def __init__(self, result: Any, request: Any, *, finish: Callable[[], None] | None = None,
                 buffer: Any = None, source: int = -1, what: str = "",
                 timeout: float | None = None, traced: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._result = result
        self._request = request  # None once complete
        self._finish = finish  # (a receive's copy into a strided or CUDA tensor)
        self._buffer = buffer  # (a send's bytes, kept alive until the request completes)
        self._source = source
        self._what = what  # "recv from rank 1 (tag 0)", for the timeout's message
        self._timeout = timeout  # the group's, for a wait() without one
        self._traced = traced
        self._lock = threading.Lock()
        # made on the first get_future() (a plain send or receive never asks)
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._request is None:
            return True
        t = recorder.begin() if self._traced is not None else 0
        with self._lock:  # (the caller and a future's thread may both wait)
            if self._request is not None:
                self._wait(timeout)
        if t:
            args = self._traced
            assert args is not None  # (t only when traced)
            recorder.end(t, f"torch.distributed.{args['Collective name']} wait",
                         recorder.COLLECTIVE, {**args, "peer": self._source})
        return True

    def _wait(self, timeout: datetime.timedelta | None) -> None:
        seconds = timeout_seconds(timeout) if timeout is not None else self._timeout
        status = mpi().Status()
        if seconds is None:
            self._request.Wait(status)
        else:
            deadline = time.monotonic() + seconds
            while not self._request.Test(status):
                if time.monotonic() > deadline:
                    raise CollectiveTimeoutError(
                        f"torch.distributed {self._what} did not complete within "
                        f"{seconds:g} s: is the matching send/recv posted on the peer?",
                        [self._source] if self._source >= 0 else [])
                time.sleep(0.0002)
        self._done(status)

    def _done(self, status: Any) -> None:
        self._request = self._buffer = None
        if self._source < 0:
            self._source = status.Get_source()
        if self._finish is not None:
            self._finish()
        if self._future is not None:
            self._future.set_result(self._result)

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = torch.futures.Future()
            if self._request is None:
                self._future.set_result(self._result)
            else:  # a thread completes it (Wait releases the GIL)
                threading.Thread(target=self._finish_in_background, daemon=True,
                                 name="mpistrat-p2p").start()
        return self._future

    def _finish_in_background(self) -> None:
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the future's waiter
            assert self._future is not None
            self._future.set_exception(exc)

    def is_completed(self) -> bool:
        if self._request is not None and self._lock.acquire(blocking=False):
            try:
                status = mpi().Status()
                if self._request is not None and self._request.Test(status):
                    self._done(status)
            finally:
                self._lock.release()
        return self._request is None

    def is_success(self) -> bool:
        return self.is_completed()

    def exception(self) -> Any:
        return None

    def result(self) -> Any:
        self.wait()
        return self._result

    def _source_rank(self) -> int:
        self.wait()
        return self._source

    def source_rank(self) -> int:
        return self._source_rank()

    def synchronize(self) -> None:
        self.wait()


class Done(dist._Work):
    """The work of a collective, finished when the call returns: ``wait()`` is free and
    ``get_future()`` is already done (its value the call's tensors)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        pass


def timeout_seconds(timeout: Any) -> float | None:
    """Seconds of a user's timeout; None for no bound (unset, or torch's default)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) \
        else float(timeout)
    if seconds <= 0 or timeout == DEFAULT_TIMEOUT:
        return None
    return seconds


try:
    from torch.distributed.constants import default_pg_timeout as DEFAULT_TIMEOUT
except ImportError:  # pragma: no cover - every torch this supports has it
    DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
