"""``ParameterServerStrategy`` over MPI: variables on ps ranks, functions on workers.

Every rank of the job constructs the strategy (collectively). Then:

* the **coordinator** (rank 0) returns from the constructor and runs the user's program:
  it creates variables (placed on the ps ranks) and schedules functions on the workers
  through a :class:`~mpistrat.ClusterCoordinator`;
* a **worker** serves the functions the coordinator schedules (``mpi4py.futures``'
  ``MPICommExecutor``: one function in flight per worker), and a **ps** rank waits inside
  MPI while the others read and update its variables by one-sided RMA
  (:class:`~mpistrat.ps.store.VariableStore`);
* when the coordinator's program ends, it shuts the workers and ps down; they leave the
  constructor with ``SystemExit(0)``: only the coordinator runs the rest of the script, as
  TF's workers and ps only run a ``Server``. (:class:`~mpistrat.ps.server.Server` is the
  same service for scripts that branch on the task type themselves.)

Inside a scheduled function the strategy is the worker's: ``strategy.run`` runs over the
worker's local replicas and ``strategy.reduce`` reduces only across them (TF: no
cross-worker reduction; workers combine only through the variables).
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from .. import trace
from ..checkpoint.manager import set_snapshot_hooks
from ..checkpoint.snapshot import SnapshotStore
from ..cross_device_ops import ReductionToOneDevice
from ..elastic.env import elastic_env
from ..runtime import stall
from ..runtime._mpi import Comm, mpi, set_state_comm, world
from ..strategy.base import Strategy, StrategyExtended
from ..strategy.mirrored import _local_replicas
from ..strategy.variables import (
    OneCopyVariable,
    VariableAggregation,
    VariableSynchronization,
    _initial,
)
from ..values import default_devices
from . import worker
from .elastic import SNAPSHOT_TAG, PartnerReceiver, partner_of, send_snapshot
from .roles import Roles, resolve_roles
from .store import ShardedHandle, VariableHandle, VariableStore

__all__ = ["ParameterServerStrategy", "PSVariable", "ShardedVariable", "shutdown_all"]

_SHUTDOWN_TAG = 4040
_STORES: dict[str, VariableStore] = {}  # this process's stores, by id (handles name them)
_STRATEGIES: dict[str, ParameterServerStrategy] = {}


class PSVariable(OneCopyVariable):
    """A variable held on a ps rank (TF's variable on ``/job:ps/task:i``); read and updated
    from the coordinator or any worker, concurrently, by one-sided MPI operations.

    ``assign_add``/``assign_sub`` are atomic accumulates (no update is lost however many
    workers add at once); ``assign`` replaces; with ``use_locking=True`` each is a
    read-modify-write under the owning ps's exclusive lock. Inside ``strategy.run`` on a
    worker with several replicas, an update follows TF's ``AggregatingVariable`` rules
    (the replicas' values merged by the aggregation, applied once). Pickled into a
    scheduled function, a variable travels as its handle.
    """

    def __init__(self, store: VariableStore, handle: VariableHandle | ShardedHandle,
                 name: str, trainable: bool = True,
                 aggregation: Any = VariableAggregation.NONE) -> None:
        self._store = store
        self._handle = handle
        self._strategy = _STRATEGIES.get(store.id)
        self._init_common(name, trainable, VariableSynchronization.ON_WRITE, aggregation)

    # -- facts without a read
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._handle.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._handle.dtype)

    @property
    def device(self) -> str:
        """The owning ps's device (the first shard's for a sharded variable)."""
        handle = self._handle
        ps = handle.shards[0].ps if isinstance(handle, ShardedHandle) else handle.ps
        return f"/job:ps/replica:0/task:{self._store.ps_ranks.index(ps)}/device:CPU:0"

    def _read_array(self) -> np.ndarray:
        return self._store.read(self._handle)

    def numpy(self) -> np.ndarray:
        return self._read_array()

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self._read_array()
        return array if dtype is None else array.astype(dtype, copy=False)

    # -- writing (OneCopyVariable decides when; this is how)
    def _merge_device(self) -> str:
        return "/cpu:0"  # a worker's replicas are reduced on the worker, then sent once

    def _apply(self, kind: str, value: np.ndarray, use_locking: bool) -> None:
        array = self._shaped(np.asarray(value, dtype=self.dtype), self.shape)
        store, handle = self._store, self._handle
        if kind == "assign":
            if use_locking:
                store.update(handle, lambda _: array)
            else:
                store.assign(handle, array)
        elif use_locking:
            sign = 1 if kind == "assign_add" else -1
            store.update(handle, lambda current: current + sign * array)
        elif kind == "assign_add":
            store.assign_add(handle, array)
        else:
            store.assign_sub(handle, array)

    def __reduce__(self) -> Any:
        return (_variable, (self._store.id, self._handle, self._name, self._trainable,
                            self._aggregation.name, type(self).__name__))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name!r} shape={self.shape} dtype={self.dtype} " \
               f"on {self.device}>"


class ShardedVariable(PSVariable):
    """A variable split along axis 0 into shards on consecutive ps ranks (TF's
    ``ShardedVariable``); reading gathers the shards, updates go to each shard's rows.

    ``variables`` lists the shards (each a :class:`PSVariable` named ``"{name}/part_{i}"``).
    """

    _handle: ShardedHandle

    @property
    def variables(self) -> list[PSVariable]:
        return [PSVariable(self._store, shard, shard.name, self._trainable)
                for shard in self._handle.shards]


def _variable(store_id: str, handle: Any, name: str, trainable: bool, aggregation: str,
              kind: str) -> PSVariable:
    """A variable unpickled on any rank of the job: bound to this rank's store."""
    store = _STORES.get(store_id)
    if store is None:
        raise RuntimeError(f"variable {name!r} belongs to a ParameterServerStrategy that "
                           f"this process does not have (store {store_id}); variables "
                           f"travel only inside the job that created them")
    cls = ShardedVariable if kind == "ShardedVariable" else PSVariable
    return cls(store, handle, name, trainable, aggregation)


class ParameterServerStrategy(Strategy):
    """TF's ``ParameterServerStrategy``: asynchronous training with variables on ps ranks
    and functions scheduled on workers by a :class:`~mpistrat.ClusterCoordinator`.

    Collective over ``comm``: every rank constructs it. The coordinator (rank 0) gets the
    strategy; workers and ps ranks serve until the coordinator's program ends, then leave
    with ``SystemExit(0)`` (see the module docstring).

    Args:
        cluster_resolver: a resolver whose cluster has ``chief``, ``ps`` and ``worker``
            jobs (``TFConfigClusterResolver``...), one task per rank in that order; or
            None (or an ``MPIClusterResolver``): the MPI world with ``num_ps`` ps ranks.
        variable_partitioner: called as ``partitioner(shape=..., dtype=...)`` for each
            variable created in ``scope()``; ``[k, 1, ...]`` shards it along axis 0
            (:mod:`mpistrat.partitioners`). None: no variable is sharded.
        num_ps: ps ranks when the resolver does not say (default ``MPISTRAT_NUM_PS``, which
            ``mpistrat run --num-ps P`` sets).
        arena_bytes: bytes of variables each ps holds (default ``MPISTRAT_PS_ARENA_BYTES``
            or 256 MiB).
        local_replicas: CPU replicas of each worker (default ``MPISTRAT_LOCAL_REPLICAS``,
            else 1); the same on every worker.
        comm: the job's communicator (default ``COMM_WORLD``).

    Raises:
        ValueError: TF's errors, on every rank: "There must be at least one ps.", "There
            must be at least one worker.", an empty cluster spec, a task that is not the
            rank's.
    """

    def __init__(self, cluster_resolver: Any = None, variable_partitioner: Any = None, *,
                 num_ps: int | None = None, arena_bytes: int | None = None,
                 local_replicas: int | None = None, comm: Comm | None = None) -> None:
        self._setup(cluster_resolver, variable_partitioner, num_ps, arena_bytes, comm,
                    local_replicas)
        if self.task_type == "chief":
            self._start_coordinator()
            return
        self._serve()
        raise SystemExit(0)

    def _setup(self, cluster_resolver: Any, variable_partitioner: Any, num_ps: int | None,
               arena_bytes: int | None, comm: Comm | None,
               local_replicas: int | None = None) -> None:
        """The collective part of construction, the same on every rank (a
        :class:`~mpistrat.Server` makes it too)."""
        base = world() if comm is None else comm
        problem = None
        if variable_partitioner is not None and not callable(variable_partitioner):
            problem = TypeError(f"variable_partitioner must be callable (e.g. "
                                f"MinSizePartitioner(...)), got {variable_partitioner!r}")
        roles: Roles = resolve_roles(cluster_resolver, num_ps, base, problem)
        replicas = _agreed_replicas(local_replicas, roles, base)
        MPI = mpi()
        self._roles = roles
        self._cluster_resolver = cluster_resolver
        self._variable_partitioner = variable_partitioner
        self._job = base.Dup()
        rank = self._job.Get_rank()
        self.task_type, self.task_id = roles.task_of(rank)
        self._store = VariableStore([*roles.ps], arena_bytes, comm=self._job)
        _STORES[self._store.id] = self._store
        _STRATEGIES[self._store.id] = self
        # coordinator + workers: the executor's communicator (ps ranks are not in it)
        self._executor_comm: Any = self._job.Split(MPI.UNDEFINED if rank in roles.ps else 0,
                                                   rank)
        local = MPI.COMM_SELF
        extended = _PSExtended(self, ReductionToOneDevice(comm=local),
                               default_devices(replicas), 1, 0, rank == roles.coordinator)
        super().__init__(extended, local)
        # an elastic job (mpistrat run --min-ranks): the coordinator's snapshots get a
        # partner copy on another host (mpistrat.ps.elastic)
        self._elastic = elastic_env()
        self._partner: int | None = None
        if self._elastic is not None:
            self._partner = partner_of(self._job.allgather(socket.gethostname()),
                                       roles.coordinator)
        self._colocate: list[PSVariable] = []
        self._lock = threading.Lock()
        self._executor_context: Any = None
        self._executor: Any = None
        self._closed = False

    # -- facts
    @property
    def num_workers(self) -> int:
        return len(self._roles.workers)

    @property
    def num_ps(self) -> int:
        return len(self._roles.ps)

    @property
    def roles(self) -> Roles:
        """The ranks of the coordinator, the ps and the workers."""
        return self._roles

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of one worker (TF: PSS reduces only across a worker's replicas)."""
        return len(self._extended.worker_devices)

    # -- the coordinator's side
    def _start_coordinator(self) -> None:
        from mpi4py.futures import MPICommExecutor

        self._executor_context = MPICommExecutor(self._executor_comm, root=0)
        self._executor = self._executor_context.__enter__()
        set_state_comm(mpi().COMM_SELF)  # checkpoints: the coordinator alone
        if self._elastic is not None:  # snapshots: whole (no function running), copied
            set_snapshot_hooks(before=_drain_all, after=self._after_snapshot)
        _EXCEPTHOOK.install()
        # at the interpreter's exit, before mpi4py.futures waits for the executor's
        # pending functions (its exit hook is a threading one, run before atexit's)
        register = getattr(threading, "_register_atexit", atexit.register)
        register(self._at_exit)

    def _shutdown(self, failed: bool = False) -> bool:
        """The end of the job (the coordinator's program has ended): stop the workers and
        the ps, release the variables. Idempotent.

        After a failure of the program (``failed``), functions still running on workers
        (stuck, perhaps) cannot be waited for: then nothing is done and False returned,
        and the job must be aborted."""
        with self._lock:
            if self._closed:
                return True
            coordinator = _COORDINATORS.get(self._store.id)
            running = coordinator._abandon() if coordinator is not None else 0
            if failed and running:
                return False
            self._closed = True
        _COORDINATORS.pop(self._store.id, None)
        self._executor_context.__exit__(None, None, None)
        if self._elastic is not None:
            set_snapshot_hooks(None, None)
            if self._partner is not None:  # the job ended well: the copy goes
                self._job.send(None, dest=self._partner, tag=SNAPSHOT_TAG)
        for ps in self._roles.ps:
            self._job.send(None, dest=ps, tag=_SHUTDOWN_TAG)
        set_state_comm(None)
        self._release()
        return True

    def _at_exit(self) -> None:
        """The coordinator's process is exiting: shut the job down, or, when the program
        died of an exception with functions still running on the workers, abort it (the
        traceback has been printed; nothing else would end the workers)."""
        if not self._shutdown(failed=_EXCEPTHOOK.failed):
            import sys

            text = (f"mpistrat: the coordinator's program failed while scheduled functions "
                    f"were still running on the workers; aborting the job "
                    f"({self.num_workers} worker(s), {self.num_ps} ps)")
            print(text, file=sys.stderr, flush=True)
            stall.trace_failure("failure", text, [self._job.Get_rank()], status=1)
            if trace.active():  # (the trace's file ends with it)
                trace.flush()
            self._job.Abort(1)

    def _after_snapshot(self, store: SnapshotStore) -> None:
        """A snapshot was taken on the coordinator: its partner copy."""
        if self._partner is not None and store.comm is not None and \
                store.comm.Get_size() == 1:
            send_snapshot(store, self._job, self._partner)

    def _release(self) -> None:
        _STORES.pop(self._store.id, None)
        _STRATEGIES.pop(self._store.id, None)
        self._store.free()
        if self._executor_comm != mpi().COMM_NULL:
            self._executor_comm.Free()
        self._job.Free()

    # -- workers and ps
    def _serve(self) -> None:
        """Serve until the coordinator shuts the job down: closures on a worker, RMA on a
        ps (which waits inside MPI, where the one-sided operations make progress).

        SIGTERM and SIGUSR1 (a preemption warning, which launchers send to every rank) are
        ignored meanwhile: the coordinator decides, e.g. with a
        ``PreemptionCheckpointHandler``, and its end ends the job; a coordinator that does
        not handle them dies, and the launcher stops the rest."""
        watch = stall.current()
        if watch is not None:  # (mpistrat run) no longer in the construction's agreement,
            # and in no watched collective until the end: tell the stall check so
            watch.active.pop(threading.get_ident(), None)
            watch.announce(f"serving as {self.task_type}:{self.task_id} until the "
                           f"coordinator's program ends")
        with _ignoring(signal.SIGTERM, signal.SIGUSR1):
            self._serve_until_shutdown()

    def _serve_until_shutdown(self) -> None:
        receiver = None
        if self._elastic is not None and self._partner == self._job.Get_rank():
            receiver = PartnerReceiver(self._job, self._roles.coordinator, self._elastic)
        if self.task_type == "ps":
            self._job.recv(source=self._roles.coordinator, tag=_SHUTDOWN_TAG)
        else:
            from mpi4py.futures import MPICommExecutor

            worker.serving(worker.WorkerState(self, self.task_id, self.num_workers,
                                              self._job.Get_rank()))
            try:
                with MPICommExecutor(self._executor_comm, root=0):
                    pass  # (a worker serves inside __enter__ until the coordinator leaves)
            finally:
                worker.serving(None)
        if receiver is not None:
            receiver.join()
        self._release()

    # -- variables
    def _create_variable(self, initial_value: Any = None, trainable: bool | None = None,
                         name: str | None = None, dtype: Any = None,
                         synchronization: Any = VariableSynchronization.AUTO,
                         aggregation: Any = VariableAggregation.NONE,
                         shape: Any = None) -> PSVariable:
        """A variable created in ``scope()`` on the coordinator: placed round-robin on the
        ps ranks, next to the variable of ``colocate_vars_with``, or sharded by the
        partitioner."""
        if worker.current() is not None:
            raise RuntimeError("variables of a ParameterServerStrategy are created on the "
                               "coordinator, in strategy.scope(), not inside a scheduled "
                               "function (nor in a dataset_fn)")
        initial = _initial(initial_value, dtype)
        name = name if name is not None else f"Variable_{self._variables_created}"
        self._variables_created += 1
        trainable = True if trainable is None else bool(trainable)
        store = self._store
        handle: VariableHandle | ShardedHandle
        if self._colocate:
            ps = self._colocate[-1]._handle
            owner = ps.shards[0].ps if isinstance(ps, ShardedHandle) else ps.ps
            handle = store.allocate(initial.shape, initial.dtype, ps=owner, name=name)
        elif self._variable_partitioner is not None and initial.ndim >= 1:
            partitions = self._variable_partitioner(shape=initial.shape, dtype=initial.dtype)
            handle = store.allocate_sharded(initial.shape, initial.dtype, partitions,
                                            name=name)
        else:
            handle = store.allocate(initial.shape, initial.dtype, name=name)
        store.assign(handle, initial)
        cls = ShardedVariable if isinstance(handle, ShardedHandle) else PSVariable
        return cls(store, handle, name, trainable, aggregation)

    def __reduce__(self) -> Any:
        return (worker.local_strategy, ())

    def __repr__(self) -> str:
        return (f"ParameterServerStrategy(1 coordinator, {self.num_ps} ps, {self.num_workers} "
                f"worker(s); this rank: {self.task_type}:{self.task_id})")


def _agreed_replicas(value: int | None, roles: Roles, comm: Comm) -> int:
    """The workers' local replicas (``local_replicas``, else ``MPISTRAT_LOCAL_REPLICAS``,
    else 1), the same on every worker: TF's rule for GPUs per worker. The same error on
    every rank otherwise."""
    problem = None
    try:
        mine = _local_replicas(value)
    except ValueError as exc:
        mine, problem = 0, str(exc)
    everyone = comm.allgather((mine, problem))
    problems = [f"rank {r}: {p}" for r, (_, p) in enumerate(everyone) if p]
    if problems:
        raise ValueError("ParameterServerStrategy: " + "; ".join(problems))
    counts = {r: everyone[r][0] for r in roles.workers}
    if len(set(counts.values())) > 1:
        raise ValueError(
            "Mismatched number of replicas per worker: "
            + ", ".join(f"worker {roles.workers.index(r)} (rank {r}) has {n}"
                        for r, n in counts.items())
            + "; give every worker the same (local_replicas=, MPISTRAT_LOCAL_REPLICAS or "
              "mpistrat run --local-replicas)")
    return counts[roles.workers[0]]


@contextlib.contextmanager
def _ignoring(*signals: int) -> Iterator[None]:
    """Ignore ``signals`` inside (main thread only: elsewhere Python cannot set them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


class _PSExtended(StrategyExtended):
    _strategy: ParameterServerStrategy

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created inside go to ``colocate_with_variable``'s ps and are never
        sharded (what optimizers do for slot variables)."""
        if not isinstance(colocate_with_variable, PSVariable):
            raise TypeError(f"colocate_vars_with takes a variable of this strategy, got "
                            f"{type(colocate_with_variable).__name__}")
        stack = self._strategy._colocate
        stack.append(colocate_with_variable)
        try:
            yield
        finally:
            stack.pop()

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return tuple(f"/job:ps/replica:0/task:{i}/device:CPU:0"
                     for i in range(self._strategy.num_ps))


_COORDINATORS: dict[str, Any] = {}  # the ClusterCoordinator of each strategy, by store id


def _drain_all() -> None:
    """A snapshot is due on the coordinator: wait until no scheduled function runs (the
    first error of one is raised, as by ``join()``), so the variables are whole."""
    for coordinator in list(_COORDINATORS.values()):
        coordinator._drain()


def shutdown_all(failed: bool = False) -> bool:
    """End every parameter-server job this process coordinates (what the coordinator does
    at exit; ``mpistrat run`` calls it when the script ends). After a failure of the
    program (``failed``), a job with functions still running is left alone, for the
    caller to abort: returns False then."""
    done = True
    for strategy in list(_STRATEGIES.values()):
        if strategy.task_type == "chief":
            done = strategy._shutdown(failed) and done
    return done


class _FailureHook:
    """Records whether the process is ending with an uncaught exception (atexit handlers
    cannot tell otherwise), chained before the previous ``sys.excepthook``."""

    def __init__(self) -> None:
        self.failed = False
        self._previous: Any = None

    def install(self) -> None:
        import sys

        if self._previous is None:
            self._previous = sys.excepthook
            sys.excepthook = self

    def __call__(self, *exc_info: Any) -> None:
        self.failed = True
        self._previous(*exc_info)


_EXCEPTHOOK = _FailureHook()
