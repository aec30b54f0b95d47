"""Time every entry at one size: the measurement loop of ``mpistrat bench``.

For each size (collective over the communicator):

1. allocate each replica's buffer once, plus a pristine copy of its input (see
   :mod:`~mpistrat.bench.check`), which is copied back before every iteration, outside
   the timed region (repeated in-place sums would otherwise grow to inf);
2. check one iteration of every entry against ``MPI_Allreduce`` of the same input (this
   also allocates scratch buffers and node communicators, so neither is timed);
3. warm up, then time rounds; a round runs every entry once, the start rotating each
   round, so slow drift of a noisy machine hits every entry alike. One iteration is
   ``Barrier; t0 = Wtime(); all-reduce; t = Wtime() - t0`` (OSU and mpi4py's bench time
   each call after a barrier); with ``check_every`` its result is verified afterwards;
4. after the last round, one ``Allreduce(MAX)`` makes every iteration's time the time of
   its slowest rank (nccl-tests and OSU report the slowest or the average rank; the
   slowest is what a training step waits for).

Warm-up and iteration counts are fixed or adaptive: by default at least 3 warm-up
rounds, continuing until 10 % of the time budget is spent (at most 100); the rounds
then aim at ``time_per_point`` seconds per (size, entry). Rank 0 decides and
broadcasts, so every rank runs the same number of collectives.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import dispatch
from ..allreduce import all_reduce
from ..backends import get_backend
from ..backends.protocol import ArrayBackend
from ..ops import ReduceOp
from ..runtime._mpi import Comm, mpi
from ..runtime.shared import free_shared, shared_empty
from ..values import PerReplica
from .check import count_wrong, fill_pattern, reference
from .config import BenchConfig
from .entries import Entry
from .results import Point

__all__ = ["Sweep"]

_MIN_WARMUP, _MAX_WARMUP, _WARMUP_SHARE = 3, 100, 0.1


def _on_devices(host: list[np.ndarray]) -> list[Any]:
    """Copies of the replicas' inputs on this rank's GPUs 0..G-1 (CuPy)."""
    import cupy  # only with GPUs: importing mpistrat never imports CuPy

    out = []
    for device, array in enumerate(host):
        with cupy.cuda.Device(device):
            out.append(cupy.asarray(array))
    return out


class Sweep:
    """Measures the entries at one size after another (every rank builds one).

    Args:
        comm: the communicator (every rank takes part).
        config: the options.
        entries: what to time, in table order.
        peers: the torch.distributed peers (:class:`~.peers.TorchPeer`), one per entry of
            kind ``"torch"``, whose label is the entry's.
    """

    def __init__(self, comm: Comm, config: BenchConfig, entries: Sequence[Entry],
                 peers: Sequence[Any] = ()) -> None:
        self.MPI = mpi()
        self.comm, self.config, self.entries = comm, config, list(entries)
        self.peers = {peer.label: peer for peer in peers}
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.replicas = config.replicas_per_rank
        self.participants = self.size * self.replicas
        self.op: ReduceOp = config.reduce_op
        self.dtype = config.np_dtype

    # ----------------------------------------------------------------- one call

    def _call(self, entry: Entry, work: list[np.ndarray], backend: ArrayBackend,
              nbytes: int) -> Callable[[int], Sequence[np.ndarray]]:
        comm, op, rpn = self.comm, self.op, self.config.ranks_per_node
        if entry.kind == "torch":
            peer, participants = self.peers[entry.label], self.participants

            def torch_call(rotation: int) -> Sequence[np.ndarray]:
                peer.all_reduce(work[0], op, participants)
                return work

            return torch_call
        alg, shards = entry.route(nbytes)
        if len(work) > 1:
            spec = entry.spec if entry.kind == "spec" else (alg, shards, -1)

            replicas = PerReplica(work)  # a plain list is a batch of tensors of their own

            def replicas_call(rotation: int) -> Sequence[np.ndarray]:
                return all_reduce(replicas, op, spec, comm, check=False, inplace=True,
                                  ranks_per_node=rpn)

            return replicas_call
        buf, run, mean = work[0], dispatch.run, op is ReduceOp.MEAN
        participants = self.participants

        def call(rotation: int) -> Sequence[np.ndarray]:
            run(alg, comm, buf, op=op, shards=shards, backend=backend, rotation=rotation,
                ranks_per_node=rpn)
            if mean:
                backend.divide(buf, participants)
            return work

        return call

    # ----------------------------------------------------------------- one size

    def measure(self, nbytes: int) -> tuple[list[Point] | None, dict[str, Any]]:
        """Time every entry on buffers of ``nbytes`` bytes (collective).

        Returns:
            The points (on rank 0; None elsewhere) and facts about the run (iterations,
            warm-up rounds, seconds).
        """
        config = self.config
        started = time.perf_counter()
        count = nbytes // self.dtype.itemsize
        host = []
        for d in range(self.replicas):
            buf = np.empty(count, dtype=self.dtype)
            fill_pattern(buf, self.rank * self.replicas + d)
            host.append(buf)
        pristine = _on_devices(host) if config.gpus_per_rank else host
        if config.shared:
            return self._measure_shared(nbytes, started, host, pristine)
        return self._measure(nbytes, started, host, pristine, [p.copy() for p in pristine])

    def _measure_shared(self, nbytes: int, started: float, host: list[np.ndarray],
                        pristine: list[Any]) -> tuple[list[Point] | None, dict[str, Any]]:
        """:meth:`_measure` on buffers in shared windows (``--shared``), freed afterwards."""
        work = [shared_empty(p.shape, p.dtype, self.comm, self.config.ranks_per_node)
                for p in pristine]
        try:
            return self._measure(nbytes, started, host, pristine, work)
        finally:
            for buffer in reversed(work):
                free_shared(buffer)

    def _measure(self, nbytes: int, started: float, host: list[np.ndarray],
                 pristine: list[Any], work: list[Any]
                 ) -> tuple[list[Point] | None, dict[str, Any]]:
        comm, MPI, config = self.comm, self.MPI, self.config
        E = len(self.entries)
        count = nbytes // self.dtype.itemsize
        backend = get_backend(work[0])
        ref = reference(comm, host, self.op, get_backend(host[0]), self.participants)
        calls = [self._call(e, work, backend, nbytes) for e in self.entries]
        sync = backend.synchronize

        def refill() -> None:
            for w, p in zip(work, pristine):
                backend.copy(w, p)
            sync()

        def timed(k: int, rotation: int, checks: list[list[int]] | None) -> float:
            refill()
            comm.Barrier()
            t0 = MPI.Wtime()
            out = calls[k](rotation)
            sync()
            t = MPI.Wtime() - t0
            if checks is not None:
                checks[k].append(count_wrong(out, ref))
            return t

        # 1. one checked iteration of every entry
        checks: list[list[int]] = [[] for _ in range(E)]
        for k in range(E):
            refill()
            checks[k].append(count_wrong(calls[k](0), ref))
        every = checks if config.check_every else None
        checked = time.perf_counter()

        gc.collect()
        gc.disable()
        try:
            # 2. warm-up rounds (timed, to size the adaptive iteration count)
            warm: list[list[float]] = [[] for _ in range(E)]
            budget = config.time_per_point * E
            rounds, w0 = 0, time.perf_counter()
            while True:
                if config.warmup is not None:
                    if rounds >= config.warmup:
                        break
                else:
                    go = None
                    if self.rank == 0:
                        spent = time.perf_counter() - w0
                        go = rounds < _MIN_WARMUP or (rounds < _MAX_WARMUP
                                                      and spent < _WARMUP_SHARE * budget)
                    if not comm.bcast(go, root=0):
                        break
                for e in range(E):
                    k = (e + rounds) % E
                    warm[k].append(timed(k, rounds, every))
                rounds += 1
            iters = config.iters if config.iters is not None else self._adaptive(warm, budget)

            # 3. timed rounds, round-robin with a rotating start
            warmed = time.perf_counter()
            times = np.zeros((iters, E), dtype=np.float64)
            for it in range(iters):
                for e in range(E):
                    k = (e + it) % E
                    times[it, k] = timed(k, rounds + it, every)
        finally:
            gc.enable()
        finished = time.perf_counter()

        # 4. each iteration's time is its slowest rank's
        local_median = np.median(times, axis=0)
        comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
        medians = comm.gather(local_median, root=0) or []  # (rank 0 gets every rank's)
        wrong = np.array(checks, dtype=np.int64).T.copy()  # (checks, E)
        comm.Allreduce(MPI.IN_PLACE, wrong, op=MPI.SUM)
        run = {"bytes": count * self.dtype.itemsize, "iters": iters, "warmup": rounds,
               "checked_iterations": int(wrong.shape[0]),
               "seconds": time.perf_counter() - started,
               "check_s": checked - started, "warmup_s": warmed - checked,
               "timed_s": finished - warmed}
        if self.rank != 0:
            return None, run
        points = []
        for e, entry in enumerate(self.entries):
            alg, shards = (entry.route(nbytes) if entry.kind != "torch" else (None, 1))
            points.append(Point(
                nbytes=count * self.dtype.itemsize, count=count, dtype=str(self.dtype),
                op=self.op.name.lower(), label=entry.label, kind=entry.kind, alg=alg,
                shards=shards, participants=self.participants,
                samples=tuple(float(t) for t in times[:, e]), warmup=rounds,
                wrong=int(wrong[:, e].max()), checked=int(wrong.shape[0]),
                wrong_iterations=int(np.count_nonzero(wrong[:, e])),
                per_rank_median=tuple(float(m[e]) for m in medians)))
        return points, run

    def _adaptive(self, warm: list[list[float]], budget: float) -> int:
        """Rounds that fill ``budget`` seconds, estimated from the second half of the
        warm-up (max over ranks); ``min_iters`` when there was no warm-up."""
        comm, MPI, config = self.comm, self.MPI, self.config
        if not warm[0]:
            return config.min_iters
        est = np.array([float(np.median(w[len(w) // 2:])) for w in warm])
        comm.Allreduce(MPI.IN_PLACE, est, op=MPI.MAX)
        iters = None
        if self.rank == 0:
            per_round = max(float(est.sum()), 1e-9)
            iters = int(min(config.max_iters,
                            max(config.min_iters, math.ceil(budget / per_round))))
        return comm.bcast(iters, root=0)
