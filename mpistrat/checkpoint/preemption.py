"""Save and stop together when the job is told to end (preemption, time limit, Ctrl-C).

Slurm sends ``SIGTERM`` when it preempts or cancels a job and at its time limit, and any
signal chosen with ``sbatch --signal=USR1@120`` that many seconds before it; ``mpiexec``
forwards both to every rank, and so does ``mpistrat run -n``. The signal reaches the ranks
at slightly different moments, in different steps, so no rank may act on it alone: the
handler's check, called once per step on every rank, ORs the ranks' flags (one small
non-blocking all-reduce) and, once any rank has its flag, saves a checkpoint on every rank's
behalf and ends every rank the same way. The restarted (requeued) job then resumes from
that checkpoint.

Two ways to call :class:`PreemptionCheckpointHandler`:

* mpistrat's, ``PreemptionCheckpointHandler(manager, signals=..., exit_status=42)`` and
  :meth:`~PreemptionCheckpointHandler.save_checkpoint_if_preempted` once per step;
* TF's, ``PreemptionCheckpointHandler(cluster_resolver, checkpoint_or_manager,
  checkpoint_dir=None, termination_config=None)``, which restores the newest checkpoint when
  it is made, and :meth:`~PreemptionCheckpointHandler.run` around each step, whose count
  (:attr:`~PreemptionCheckpointHandler.total_run_calls`) is saved with the checkpoint.

:class:`TerminationConfig` customises the handler as TF's does; :class:`PreemptionWatcher`
only reports that a notice arrived.
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from ..cluster.base import ClusterResolver
from ..runtime import stall
from ..runtime._mpi import mpi
from .checkpoint import Checkpoint
from .manager import CheckpointManager

__all__ = ["PreemptionCheckpointHandler", "TerminationConfig", "PreemptionWatcher",
           "PREEMPTION_EXIT_STATUS"]

PREEMPTION_EXIT_STATUS = 42  # "saved and stopped, run me again": for the batch script

_DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")


class TerminationConfig:
    """How a :class:`PreemptionCheckpointHandler` learns of, and reacts to, the end of the
    job (TF's ``tf.distribute.experimental.TerminationConfig``).

    Args:
        termination_watcher_fn: a cheap, non-blocking function returning True once this
            process should stop (say, a file the platform writes, or a metadata query). It
            is called at each check, on every rank; one rank's True stops every rank, as a
            signal does. The signals are still caught.
        exit_fn: called after the checkpoint is saved, instead of ending every rank with
            ``SystemExit(exit_status)``; whatever it returns, the handler then returns True.
        grace_period: seconds between the first notice and the platform's kill (Slurm's
            ``--signal=USR1@120``: 120). With a grace period the ranks go on training and save
            as late as is safe: when less than twice the last save's duration (at first the
            restore's) plus a tenth of the period is left. None or 0: save at once.
        save_fn: called instead of the handler's own save (it must be collective: every rank
            calls it), with the arguments given to ``save_checkpoint_if_preempted``.

    Raises:
        TypeError: a function that is not callable, or a grace period that is not a number.
        ValueError: a negative grace period.
    """

    def __init__(self, termination_watcher_fn: Callable[[], bool] | None = None,
                 exit_fn: Callable[[], Any] | None = None,
                 grace_period: float | None = None,
                 save_fn: Callable[..., Any] | None = None) -> None:
        for name, fn in (("termination_watcher_fn", termination_watcher_fn),
                         ("exit_fn", exit_fn), ("save_fn", save_fn)):
            if fn is not None and not callable(fn):
                raise TypeError(f"TerminationConfig {name} must be a function or None, got "
                                f"{type(fn).__name__}")
        if grace_period is not None:
            if isinstance(grace_period, bool) or not isinstance(grace_period, (int, float)):
                raise TypeError(f"TerminationConfig grace_period must be a number of seconds "
                                f"or None, got {grace_period!r}")
            if not grace_period >= 0:
                raise ValueError(f"TerminationConfig grace_period must be >= 0 seconds, got "
                                 f"{grace_period!r}")
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn
        self.grace_period = float(grace_period or 0.0)
        self.save_fn = save_fn

    def __repr__(self) -> str:
        return (f"TerminationConfig(termination_watcher_fn={self.termination_watcher_fn!r}, "
                f"exit_fn={self.exit_fn!r}, grace_period={self.grace_period}, "
                f"save_fn={self.save_fn!r})")


class _Signals:
    """Catch ``signals`` in this process (main thread only), passing each on to a Python
    handler installed before, so that a watcher and a handler can both listen."""

    def __init__(self, signals: Iterable[Any], on_signal: Callable[[int], None],
                 owner: str) -> None:
        self._on_signal = on_signal
        self._saved: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(f"{owner} installs signal handlers, which Python allows only "
                               f"in the main thread; create it there (before starting "
                               f"threads that train)")
        numbers = [_signal_number(sig) for sig in signals]
        for number in numbers:
            self._saved[number] = signal.signal(number, self._catch)

    def _catch(self, signum: int, frame: Any) -> None:
        self._on_signal(signum)
        previous = self._saved.get(signum)
        if callable(previous):
            previous(signum, frame)

    def close(self) -> None:
        for number, handler in self._saved.items():
            signal.signal(number, handler)
        self._saved.clear()


class PreemptionCheckpointHandler:
    """Turn a termination notice into a checkpoint saved at a step every rank agrees on.

    Create it on every rank (in the main thread: it installs signal handlers). mpistrat's
    form, ``PreemptionCheckpointHandler(manager, signals=..., exit_status=...)``: call
    :meth:`save_checkpoint_if_preempted` once per step on every rank. TF's form,
    ``PreemptionCheckpointHandler(cluster_resolver, checkpoint_or_checkpoint_manager,
    checkpoint_dir=None, termination_config=None)``: the newest checkpoint is restored now,
    and each step runs through :meth:`run`.

    Args:
        cluster_resolver: TF's form: the job's :class:`~mpistrat.cluster.ClusterResolver`, or
            None (the ranks of the checkpoint's communicator). mpistrat's form: the
            :class:`CheckpointManager` (and nothing positional after it).
        checkpoint_or_checkpoint_manager: TF's form: a :class:`Checkpoint` (then
            ``checkpoint_dir`` is required and the handler keeps the newest save there) or a
            :class:`CheckpointManager`.
        checkpoint_dir: where a :class:`Checkpoint`'s saves go.
        termination_config: a :class:`TerminationConfig`.
        signals: the signals to catch (names or numbers); default ``SIGTERM``, ``SIGUSR1``.
        exit_status: the status every rank ends with after saving (``SystemExit``); None
            returns True instead (check :attr:`preempted`). A ``termination_config.exit_fn``
            replaces it.

    Attributes:
        received: the first signal this rank caught (None before).
        preempted: True once the ranks agreed to stop and the checkpoint was saved.
        saved_path: that checkpoint.
        restored_path: TF's form: the checkpoint restored at creation, or None.
    """

    def __init__(self, cluster_resolver: Any = None, checkpoint_or_checkpoint_manager: Any = None,
                 checkpoint_dir: Any = None, termination_config: TerminationConfig | None = None,
                 *, signals: Iterable[Any] = _DEFAULT_SIGNALS,
                 exit_status: int | None = PREEMPTION_EXIT_STATUS) -> None:
        self._tf_form = not isinstance(cluster_resolver, CheckpointManager)
        self.restored_path: str | None = None
        self._run_calls = 0
        self._restore_seconds = 0.0
        if self._tf_form:
            manager = self._tf_manager(cluster_resolver, checkpoint_or_checkpoint_manager,
                                       checkpoint_dir)
            self.cluster_resolver = cluster_resolver
        else:
            if checkpoint_or_checkpoint_manager is not None or checkpoint_dir is not None:
                raise TypeError(
                    "PreemptionCheckpointHandler(manager, ...) takes signals= and exit_status= "
                    "as keywords; TF's form is PreemptionCheckpointHandler(cluster_resolver, "
                    "checkpoint_or_checkpoint_manager, checkpoint_dir, termination_config)"
                )
            manager = cluster_resolver
            self.cluster_resolver = None
        if termination_config is not None and not isinstance(termination_config,
                                                             TerminationConfig):
            raise TypeError(f"termination_config must be an mpistrat TerminationConfig or "
                            f"None, got {type(termination_config).__name__}")
        self.manager = manager
        self.termination_config = termination_config or TerminationConfig()
        self.exit_status = exit_status
        self.received: int | None = None
        self.preempted = False
        self.saved_path: str | None = None
        self._noticed_at: float | None = None  # when this rank first learnt of the end
        self._save_seconds: float | None = None
        self._flags = np.zeros(3, dtype=np.int64)  # signal, watcher fired, ms since notice
        self._signals = _Signals(signals, self._catch, "PreemptionCheckpointHandler")
        if self._tf_form:
            started = time.perf_counter()
            self.restored_path = manager.restore_or_initialize()
            self._restore_seconds = time.perf_counter() - started
            found = re.search(r"-(\d+)$", self.restored_path or "")
            self._run_calls = int(found.group(1)) if found else 0

    @staticmethod
    def _tf_manager(cluster_resolver: Any, target: Any, checkpoint_dir: Any) -> CheckpointManager:
        if cluster_resolver is not None and not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(
                f"PreemptionCheckpointHandler's first argument must be a CheckpointManager "
                f"(mpistrat's form) or a ClusterResolver or None (TF's form), got "
                f"{type(cluster_resolver).__name__}"
            )
        if isinstance(target, CheckpointManager):
            return target
        if isinstance(target, Checkpoint):
            if checkpoint_dir is None:
                raise ValueError("PreemptionCheckpointHandler with a Checkpoint needs "
                                 "checkpoint_dir= (where its saves go), or pass a "
                                 "CheckpointManager instead")
            return CheckpointManager(target, checkpoint_dir, max_to_keep=1)
        raise TypeError(f"checkpoint_or_checkpoint_manager must be an mpistrat Checkpoint or "
                        f"CheckpointManager, got {type(target).__name__}")

    def _catch(self, signum: int) -> None:
        if self.received is None:
            self.received = signum
            self._noticed_at = time.monotonic()

    def close(self) -> None:
        """Put the previous signal handlers back."""
        self._signals.close()

    def __enter__(self) -> PreemptionCheckpointHandler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def total_run_calls(self) -> int:
        """The number of :meth:`run` calls of this training: restored with the checkpoint
        (the handler saves checkpoint ``N`` after ``N`` calls), so a resumed loop starts at
        ``total_run_calls // steps_per_epoch``, step ``total_run_calls % steps_per_epoch``."""
        return self._run_calls

    def run(self, distributed_train_function: Callable[..., Any], *args: Any,
            **kwargs: Any) -> Any:
        """Collective: first the check (if any rank has had a notice: save, then end every
        rank), then one step, ``distributed_train_function(*args, **kwargs)``, whose result
        is returned; :attr:`total_run_calls` counts it."""
        if not self.preempted and self._should_save():  # (saved once, if exit_fn returns)
            self._save_and_exit((), {"checkpoint_number": self._run_calls}
                                if self._tf_form else {})
        result = distributed_train_function(*args, **kwargs)
        self._run_calls += 1
        return result

    def save_checkpoint_if_preempted(self, *args: Any, **kwargs: Any) -> bool:
        """Collective: if any rank has had a notice, save a checkpoint and stop.

        ``args``/``kwargs`` go to the save: the manager's ``save(checkpoint_number=None)``
        (TF's form numbers it :attr:`total_run_calls` by default), or the
        ``TerminationConfig.save_fn``.

        Returns:
            False when no rank has had a notice (carry on). True after saving with
            ``exit_status=None`` or an ``exit_fn``; otherwise ``SystemExit(exit_status)`` on
            every rank.
        """
        if self.preempted:
            return True
        if not self._should_save():
            return False
        if self._tf_form and not args and "checkpoint_number" not in kwargs:
            kwargs["checkpoint_number"] = self._run_calls
        return self._save_and_exit(args, kwargs)

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """TF's scope for ``TPUStrategy``, where a preemption surfaces as an error inside
        the step; TF's ``MultiWorkerMirroredStrategy`` does not need it and neither does
        mpistrat (a notice is a flag read at the next check). Code that uses it runs."""
        yield

    def _should_save(self) -> bool:
        if self.preempted:
            return True
        config = self.termination_config
        if config.termination_watcher_fn is not None and self._flags[1] == 0 \
                and config.termination_watcher_fn():
            self._flags[1] = 1
            if self._noticed_at is None:
                self._noticed_at = time.monotonic()
        self._flags[0] = self.received or 0
        self._flags[2] = 0 if self._noticed_at is None else \
            int((time.monotonic() - self._noticed_at) * 1000)
        self._allreduce_max()
        if not (self._flags[0] or self._flags[1]):
            return False
        if config.grace_period > 0:  # train on while it is safe: the earliest notice counts
            margin = 2 * (self._save_seconds if self._save_seconds is not None
                          else self._restore_seconds) + config.grace_period / 10
            if self._flags[2] / 1000 < config.grace_period - margin:
                return False
        return True

    def _allreduce_max(self) -> None:
        MPI = mpi()
        comm = self.manager.checkpoint.comm
        watch = stall.current()
        if watch is not None:  # under mpistrat run: a rank that never calls is reported
            watch.allreduce(comm, self._flags, "save_checkpoint_if_preempted")
            return
        request = comm.Iallreduce(MPI.IN_PLACE, self._flags, op=MPI.MAX)
        pause = 1e-5
        while not request.Test():  # polled, so signal handlers run meanwhile
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _save_and_exit(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        config = self.termination_config
        started = time.perf_counter()
        if config.save_fn is not None:
            config.save_fn(*args, **kwargs)
            self.saved_path = None
        else:
            self.saved_path = self.manager.save(*args, **kwargs)
        self._save_seconds = time.perf_counter() - started
        self.preempted = True
        if self.manager.checkpoint.comm.Get_rank() == 0:
            why = (signal.Signals(int(self._flags[0])).name if self._flags[0]
                   else "the termination watcher's notice")
            where = f"saved {self.saved_path}" if self.saved_path else "saved (save_fn)"
            print(f"mpistrat: {why} received; {where} and stopping so the job can be "
                  f"restarted from it", file=sys.stderr, flush=True)
        if config.exit_fn is not None:
            config.exit_fn()
            return True
        if self.exit_status is not None:
            raise SystemExit(self.exit_status)
        return True


class PreemptionWatcher:
    """Notes that this process was told to end (TF's
    ``tf.distribute.experimental.PreemptionWatcher``): :attr:`preemption_message` is None
    until one of ``signals`` arrives, then says which signal and when.

    Unlike :class:`PreemptionCheckpointHandler` it saves nothing and takes no collective:
    it is for code that wants to react on its own (stop scheduling work, write a marker).
    Under ``mpiexec``, ``mpistrat run`` and ``srun`` every rank receives the signal, so
    every rank's watcher sees it. Create it in the main thread.

    Args:
        signals: names or numbers; default ``SIGTERM`` and ``SIGUSR1``.
    """

    def __init__(self, signals: Iterable[Any] = _DEFAULT_SIGNALS) -> None:
        self._message: str | None = None
        self._signals = _Signals(signals, self._catch, "PreemptionWatcher")

    def _catch(self, signum: int) -> None:
        if self._message is None:
            self._message = (f"{signal.Signals(signum).name} received at "
                             f"{time.strftime('%Y-%m-%d %H:%M:%S')}: the job is being ended")

    @property
    def preemption_message(self) -> str | None:
        """None, or which signal arrived and when."""
        return self._message

    def block_until_worker_exit(self, timeout: float | None = None) -> bool:
        """After a notice, wait for the end the notice announced: the platform ends this
        process, so the call returns only if ``timeout`` seconds pass first (False).
        Without a notice it returns False at once: there is nothing to wait for."""
        if self._message is None:
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is None or time.monotonic() < deadline:  # (short sleeps: signals run)
            left = 0.1 if deadline is None else deadline - time.monotonic()
            time.sleep(min(0.1, max(0.0, left)))
        return False

    def close(self) -> None:
        """Put the previous signal handlers back."""
        self._signals.close()

    def __enter__(self) -> PreemptionWatcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _signal_number(sig: Any) -> int:
    if isinstance(sig, str):
        name = sig.upper() if sig.upper().startswith("SIG") else "SIG" + sig.upper()
        try:
            return int(getattr(signal, name))
        except AttributeError:
            raise ValueError(f"unknown signal {sig!r}; give a name such as 'SIGUSR1' or "
                             f"'TERM', or a number") from None
    return int(sig)
