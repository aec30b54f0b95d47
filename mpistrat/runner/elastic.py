"""``mpistrat run -n N --min-ranks M``: keep training when ranks are lost, by launching
the job again on the ranks that are left.

Each launch runs under its own :class:`~mpistrat.runner.monitor.JobMonitor`, all with
the job's one id and one secret, and its ranks get the variables of
:class:`mpistrat.elastic.env.ElasticEnv` (which launch this is, the sizes so far, what
was lost). After a launch ends, :func:`decide` tells from the monitor's records what was
lost and whether to launch again:

* status 0: done;
* a signal passed on to the launcher (Ctrl-C, SIGTERM): never restarted;
* ranks **lost**: ranks that died without announcing their end before any rank announced
  a failure (:func:`~mpistrat.runner.monitor.vanished_records`), or ranks that never
  announced it and whose connection stayed open (the far side of a network partition).
  Across hosts, the unit lost is the host: that of the first rank that vanished, and
  every host with silent ranks. On one host, a rank killed makes hydra end the others
  within milliseconds, so only the first rank that vanished is lost. The job is launched
  again on what is left, unless that is below ``--min-ranks`` or ``--max-restarts`` are
  spent;
* nothing lost (a rank announced a failure first: a bug in the script would only recur):
  the job ends with that status, as without ``--min-ranks``.

A parameter-server job (``--num-ps P``) is relaunched the same way: the relaunch's ranks
are numbered afresh, rank 0 the coordinator and ranks 1..P the ps again, so whatever was
lost (a worker, a ps, the coordinator) the relaunch has fewer workers; it needs at least
``P + 2`` ranks (reason ``"ps-ranks"`` otherwise). The coordinator's snapshots bring the
ps variables back (:mod:`mpistrat.ps.elastic`).

A relaunch across hosts gets a hydra host file of its own (``HYDRA_HOST_FILE``, in a
private temporary directory): the hosts of the previous launch, in their order, with the
ranks each had, the lost ones left out. When the job's own host file is known, a relaunch
grows back towards the first launch's size into its free slots, and onto hosts lost in
earlier launches that answer again (:mod:`mpistrat.runner.probe` probes them in the
background; not inside Slurm, whose allocation does not take a node back).
:func:`run_elastic` returns every launch's :class:`LaunchRecord` (sizes, hosts, status,
what was lost, and when), for tests and benchmarks.

Inside a Slurm allocation (``sbatch --no-kill``, so that Slurm keeps the job when it
marks the lost node down) hydra starts its proxies with ``srun``, one job step per
launch, and reads the same host file (``srun --nodelist`` the survivors). A relaunch's
step must overlap the lost launch's (``SLURM_OVERLAP=1``, srun's ``--overlap``): that
step never ends in slurmctld, since its lost node cannot report its end, and it keeps
what it held on the survivors' nodes (all their CPUs or GPUs, as a proxy step does), so
without it the relaunch's ``srun`` would wait for ever ("step creation temporarily
disabled ... Requested nodes are busy"; measured with Slurm 22.05: still so minutes
later, after the node was marked down and removed from the job).
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .._atomic import write_atomically
from ..checkpoint.snapshot import remove_job
from ..elastic.env import ElasticEnv
from ..errors import MpistratError, RunSetupError
from ..launch.hugepages import malloc_hugepages_env
from ..launch.mpiexec import find_launcher
from . import auth
from .hosts import name_ranks
from .launch import host_file, launch_command, self_launch
from .launch import job_hosts as _job_hosts
from .monitor import JobMonitor, RankRecord, bind_address, vanished_records
from .options import RunOptions
from .probe import HostProber, hydra_probe, probe_every

__all__ = ["ElasticOptions", "Decision", "LaunchRecord", "ElasticResult", "decide",
           "run_elastic", "host_file_text", "host_file_capacity", "DEFAULT_MAX_RESTARTS",
           "DEFAULT_SNAPSHOT_EVERY"]

DEFAULT_MAX_RESTARTS = 3
DEFAULT_SNAPSHOT_EVERY = 0  # auto (mpistrat.elastic.env.AUTO_SHARE)
_HOST_FILE = "HYDRA_HOST_FILE"
_OVERLAP = "SLURM_OVERLAP"  # srun --overlap (Slurm >= 20.11; older versions ignore it)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ElasticOptions:
    """What ``--min-ranks``, ``--max-restarts`` and ``--snapshot-every`` asked for,
    checked against the job's other options.

    Attributes:
        ranks: the ranks of the first launch (``-n N``).
        min_ranks: the fewest ranks the job may go on with (``--min-ranks M``).
        max_restarts: how many times the job may be launched again.
        snapshot_every: steps between two snapshots (passed to the ranks only).
        timeout: the job's ``--timeout`` (needed: see below).
        num_ps: the job's ``--num-ps`` (a parameter-server job): every launch keeps
            that many ps ranks and needs at least ``num_ps + 2`` ranks (the
            coordinator, the ps, a worker); a relaunch has fewer workers.

    Raises:
        ValueError: a value out of range, no ``--timeout`` (a partition would leave the
            ranks on this side waiting for ever, and the job never restarted), or
            ``--num-ps P`` with ``-n`` below ``P + 2``; the message names the value,
            what was expected, and the fix.
    """

    ranks: int
    min_ranks: int
    max_restarts: int = DEFAULT_MAX_RESTARTS
    snapshot_every: int = DEFAULT_SNAPSHOT_EVERY
    timeout: float | None = None
    num_ps: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.ranks) or self.ranks < 1:
            raise ValueError(f"-n must be a number of ranks >= 1, got {self.ranks!r}")
        if not _is_int(self.min_ranks) or not 1 <= self.min_ranks <= self.ranks:
            raise ValueError(
                f"--min-ranks must be a number of ranks from 1 to -n {self.ranks} (the ranks "
                f"the job starts with), got {self.min_ranks!r}; give --min-ranks M with "
                f"1 <= M <= {self.ranks}")
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be an integer >= 0 (0: never launch "
                             f"again), got {self.max_restarts!r}")
        if not _is_int(self.snapshot_every) or self.snapshot_every < 0:
            raise ValueError(f"--snapshot-every must be a number of steps >= 1, or auto, got "
                             f"{self.snapshot_every!r}")
        if self.num_ps is not None:
            if not _is_int(self.num_ps) or self.num_ps < 1:
                raise ValueError(f"--num-ps must be a number of ps ranks >= 1, got "
                                 f"{self.num_ps!r}")
            if self.ranks < self.num_ps + 2:
                raise ValueError(
                    f"-n {self.ranks} with --num-ps {self.num_ps} leaves no worker: a "
                    f"parameter-server job needs at least {self.num_ps + 2} ranks (the "
                    f"coordinator, {self.num_ps} ps, a worker); give -n "
                    f"{self.num_ps + 2} or more")
        if self.timeout is None:
            raise ValueError(
                f"--min-ranks {self.min_ranks} needs --timeout SECONDS (or "
                f"MPISTRAT_COLLECTIVE_TIMEOUT): without it, the ranks on this launcher's "
                f"side of a network partition wait for the far side for ever and the job "
                f"is never launched again; add e.g. --timeout 60")
        if not (isinstance(self.timeout, (int, float)) and 0 < self.timeout < math.inf):
            raise ValueError(f"--timeout must be a number of seconds > 0, got "
                             f"{self.timeout!r}")


@dataclass(frozen=True)
class Decision:
    """What one launch's end means (:func:`decide`).

    Attributes:
        action: ``"done"`` (status 0), ``"restart"`` or ``"stop"``.
        reason: ``"finished"``, ``"lost"`` (restart), or why it stops: ``"signal"``
            (passed on by this launcher), ``"failure"`` (nothing lost: a rank announced a
            failure first, or the launcher failed by itself), ``"unknown"`` (ranks that
            never reached the monitor: where they ran is not known), ``"min-ranks"``,
            ``"max-restarts"``, ``"ps-ranks"`` (a parameter-server job would be left
            without a worker: fewer than ``--num-ps`` + 2 ranks).
        lost_ranks: the ranks (of this launch) that were lost.
        lost_hosts: the hosts lost whole (empty when one rank of one host is lost).
        lost: what was lost, as :attr:`~mpistrat.elastic.env.ElasticEnv.lost` says it
            (``host``, or ``host/rank``).
        hosts: this launch's hosts with their ranks, in the order of their lowest rank.
        survivors: the hosts, with their ranks, that a relaunch would run on.
        message: what to print (``mpistrat run: ...``); None: nothing beyond the
            monitor's summary.
    """

    action: str
    reason: str
    lost_ranks: tuple[int, ...] = ()
    lost_hosts: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    hosts: tuple[tuple[str, int], ...] = ()
    survivors: tuple[tuple[str, int], ...] = ()
    message: str | None = None

    @property
    def size(self) -> int:
        """The ranks of a relaunch (the survivors')."""
        return sum(n for _, n in self.survivors)

    @property
    def restart(self) -> bool:
        return self.action == "restart"


def _hosts(records: Mapping[int, RankRecord]) -> tuple[tuple[str, int], ...]:
    """The hosts of ``records`` with their number of ranks, in the order of their lowest
    rank."""
    counts: dict[str, int] = {}
    for rank in sorted(records):
        host = records[rank].host
        counts[host] = counts.get(host, 0) + 1
    return tuple(counts.items())


def _placement(hosts: Sequence[tuple[str, int]]) -> str:
    return ", ".join(f"{host}:{n}" for host, n in hosts)


def _ranks(n: int) -> str:
    return f"{n} rank{'' if n == 1 else 's'}"


def decide(records: Mapping[int, RankRecord], size: int, status: int, *,
           signals: Sequence[object] = (), sizes: Sequence[int] = (),
           options: ElasticOptions,
           capacity: Sequence[tuple[str, int]] | None = None,
           excluded: Sequence[str] = ()) -> Decision:
    """What the end of one launch means: a pure function of what its monitor recorded.

    Args:
        records: the monitor's records (rank → :class:`~mpistrat.runner.monitor.
            RankRecord`), taken once the launcher ended.
        size: the ranks of this launch.
        status: the launcher's exit status.
        signals: the signals this launcher passed on to it (``JobMonitor.signals``).
        sizes: the size of every launch so far, this one last (its length - 1 is the
            number of restarts used).
        capacity: the hosts of the job's host file with their slots (None: not known):
            a relaunch grows back towards the first launch's size into their free
            slots — the survivors' first, then hosts the job has not used — but never
            onto a host lost in this launch or ``excluded`` (lost before).
        options: the job's :class:`ElasticOptions`.
    """
    sizes = tuple(sizes) or (size,)
    hosts = _hosts(records)
    if status == 0:
        return Decision("done", "finished", hosts=hosts)
    if signals:
        return Decision("stop", "signal", hosts=hosts)
    vanished = vanished_records(records)
    silent = sorted(r.rank for r in records.values() if r.status is None and r.closed is None)
    missing = sorted(set(range(size)) - set(records))
    if not vanished and not silent:
        if missing and len(sizes) > 1 and not any(r.status for r in records.values()):
            # a relaunch that ended before every rank had started (a host lost while it
            # came up, a rank killed at its start): no rank's failure, nothing known to
            # leave out (a first launch that fails so is hydra's to explain)
            return Decision("stop", "unknown", hosts=hosts, message=(
                f"mpistrat run: the launch on {_ranks(size)} ended (status {status}) "
                f"before rank(s) {missing} reached this launcher's monitor, so what was "
                f"lost is not known; not launching again (launch sizes so far: "
                f"{', '.join(str(n) for n in sizes)}). Rerun the job to resume "
                f"from the newest complete checkpoint on disk."))
        return Decision("stop", "failure", hosts=hosts)
    hostnames = [records[r].host if r in records else "?" for r in range(size)]
    if len(hosts) == 1 and not missing:
        # one host: hydra ends the others within ms of the first death; only it was lost
        host = hosts[0][0]
        lost_ranks = (vanished[0].rank,) if vanished else tuple(silent)
        lost_hosts: tuple[str, ...] = ()
        lost = tuple(f"{host}/{rank}" for rank in lost_ranks)
        survivors: tuple[tuple[str, int], ...] = \
            ((host, size - len(lost_ranks)),) if size > len(lost_ranks) else ()
    else:
        first = {vanished[0].host} if vanished else set()
        gone = first | {records[r].host for r in silent}
        lost_hosts = tuple(h for h, _ in hosts if h in gone)
        lost_ranks = tuple(r for r in sorted(records) if records[r].host in gone)
        lost = lost_hosts
        survivors = tuple((h, n) for h, n in hosts if h not in gone)
    what = f"lost {name_ranks(lost_ranks, hostnames)}"
    so_far = ", ".join(str(n) for n in sizes)
    rerun = "Rerun the job to resume from the newest complete checkpoint on disk."
    loss = Decision("stop", "lost", lost_ranks, lost_hosts, lost, hosts, survivors)
    if missing:
        return replace(loss, reason="unknown", message=(
            f"mpistrat run: {what}; not launching again: rank(s) {missing} never reached "
            f"this launcher's monitor, so where they ran is not known (launch sizes so far: "
            f"{so_far}). {rerun}"))
    if capacity:
        survivors = _grow(survivors, capacity, {*lost_hosts, *excluded}, sizes[0])
        loss = replace(loss, survivors=survivors)
    left = loss.size
    if options.num_ps is not None and left < options.num_ps + 2:
        return replace(loss, reason="ps-ranks", message=(
            f"mpistrat run: {what}; not launching again: {_ranks(left)} would be left, "
            f"fewer than the {options.num_ps + 2} a parameter-server job with --num-ps "
            f"{options.num_ps} needs (the coordinator, {options.num_ps} ps, a worker; "
            f"launch sizes so far: {so_far}). {rerun}"))
    if left < options.min_ranks:
        return replace(loss, reason="min-ranks", message=(
            f"mpistrat run: {what}; not launching again: {_ranks(left)} would be left, "
            f"below --min-ranks {options.min_ranks} (launch sizes so far: {so_far}). "
            f"{rerun}"))
    used = len(sizes) - 1
    if used >= options.max_restarts:
        return replace(loss, reason="max-restarts", message=(
            f"mpistrat run: {what}; not launching again: --max-restarts "
            f"{options.max_restarts} spent ({used} restart{'' if used == 1 else 's'} so "
            f"far; launch sizes so far: {so_far}). {rerun}"))
    roles = "" if options.num_ps is None else (
        f": 1 coordinator, {options.num_ps} ps, {_workers(left - 1 - options.num_ps)}")
    return replace(loss, action="restart", message=(
        f"mpistrat run: {what}; restart {used + 1} of {options.max_restarts} on "
        f"{_ranks(left)} ({_placement(survivors)}){roles}"))


def _grow(survivors: Sequence[tuple[str, int]], capacity: Sequence[tuple[str, int]],
          lost: set[str], target: int) -> tuple[tuple[str, int], ...]:
    """``survivors`` with more ranks, up to ``target`` in all: first into the free slots
    of their own hosts, then onto the hosts of ``capacity`` not used and not ``lost``,
    in the host file's order."""
    slots = dict(capacity)
    grown = dict(survivors)
    total = sum(grown.values())
    for host in list(grown):
        more = min(max(slots.get(host, 0) - grown[host], 0), target - total)
        grown[host] += more
        total += more
    for host, free in capacity:
        if total >= target:
            break
        if host not in grown and host not in lost and free > 0:
            grown[host] = min(free, target - total)
            total += grown[host]
    return tuple(grown.items())


def host_file_capacity(path: str | None) -> list[tuple[str, int]] | None:
    """The hosts of a hydra host file (:func:`~mpistrat.runner.launch.host_file`) with
    their slots (1 where a line gives none); None when there is none, or a line's slots
    are not a number >= 1."""
    entries = host_file(path) if path else None
    if entries is None or not all(slots == "" or (slots.isdigit() and int(slots) >= 1)
                                  for _, slots in entries):
        return None
    return [(host, int(slots) if slots else 1) for host, slots in entries]


def _workers(n: int) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class LaunchRecord:
    """One launch of an elastic job, as :func:`run_elastic` saw it. Times are
    ``time.time()`` values.

    Attributes:
        restart: 0 for the first launch, then 1, 2, ...
        size: its ranks.
        hosts: its hosts with their ranks (from the monitor), in the order of their
            lowest rank.
        status: the launcher's exit status.
        decision: what its end meant (:func:`decide`).
        started: when its ``mpiexec`` was started.
        ended: when its launcher ended: the loss detected.
        lost_at: when the first rank that vanished closed its connection (None: none
            vanished, e.g. only a partition's silent ranks were lost).
        relaunched: when the next launch was started (None: it was the last).
    """

    restart: int
    size: int
    hosts: tuple[tuple[str, int], ...]
    status: int
    decision: Decision
    started: float
    ended: float
    lost_at: float | None = None
    relaunched: float | None = None

    @property
    def lost(self) -> tuple[str, ...]:
        """What this launch lost (``host`` or ``host/rank``)."""
        return self.decision.lost

    @property
    def loss(self) -> float:
        """When the loss happened, as far as is known: :attr:`lost_at`, else
        :attr:`ended`."""
        return self.lost_at if self.lost_at is not None else self.ended

    @property
    def detection_s(self) -> float:
        """Seconds from the loss to its launcher's end."""
        return self.ended - self.loss

    @property
    def recovery_s(self) -> float | None:
        """Seconds from the loss to the next launch's start (None: not relaunched)."""
        return None if self.relaunched is None else self.relaunched - self.loss


@dataclass(frozen=True)
class ElasticResult:
    """What :func:`run_elastic` did: the exit status, and every launch in order."""

    status: int
    job: str
    launches: tuple[LaunchRecord, ...] = field(default_factory=tuple)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(launch.size for launch in self.launches)


def host_file_text(hosts: Sequence[tuple[str, int]]) -> str:
    """A hydra host file: ``host:slots`` lines, in order."""
    return "".join(f"{host}:{n}\n" for host, n in hosts)


Launch = Callable[[list[str]], int]


def _prober(capacity: Sequence[tuple[str, int]] | None,
            mpiexec: str | None) -> HostProber | None:
    """What probes the hosts the job loses (hydra over a host file, outside Slurm), or
    None.

    Raises:
        RunSetupError: ``MPISTRAT_ELASTIC_PROBE_EVERY`` is not a number of seconds > 0.
    """
    if not capacity or os.environ.get("SLURM_JOB_ID"):
        return None
    try:
        every = probe_every()
    except ValueError as exc:
        raise RunSetupError(f"mpistrat run: {exc}") from None
    try:
        launcher = find_launcher(mpiexec)
    except MpistratError:
        return None  # (the launch itself says so)
    return HostProber(hydra_probe(launcher.path), every) if launcher.flavour == "mpich" \
        else None


def run_elastic(options: RunOptions, elastic: ElasticOptions, mpiexec: str | None = None, *,
                launch: Launch | None = None, job_hosts: Callable[[], list[str] | None]
                | None = None, prober: HostProber | None = None) -> ElasticResult:
    """Run ``options`` on ``elastic.ranks`` ranks, launching the job again on what is left
    each time ranks are lost (:func:`decide`), until it ends otherwise.

    Prints the monitor's summary of every failed launch, a line for every restart (what
    was lost, on how many ranks and hosts it goes on, how long after the loss), and why it
    stops when it stops after a loss. ``launch`` runs an ``mpiexec`` command line
    (default :func:`~mpistrat.runner.launch.self_launch`), ``job_hosts`` tells where
    ``mpiexec`` will start ranks (default :func:`~mpistrat.runner.launch.job_hosts`),
    ``prober`` which hosts lost earlier answer again (default: hydra's, see
    :mod:`mpistrat.runner.probe`, when the host file is known).
    """
    launch = self_launch if launch is None else launch
    job_hosts = _job_hosts if job_hosts is None else job_hosts
    job = secrets.token_hex(16)
    secret = auth.new_secret()
    sizes = [elastic.ranks]
    lost: list[str] = []
    launches: list[LaunchRecord] = []
    saved = {name: os.environ.get(name) for name in (_HOST_FILE, _OVERLAP)}
    # the host file's slots: a relaunch may grow back into the free ones
    capacity = host_file_capacity(saved[_HOST_FILE])
    if prober is None:
        prober = _prober(capacity, mpiexec)
    directory: str | None = None
    try:
        while True:
            size = sizes[-1]
            rank_env = dict(malloc_hugepages_env() or {})
            rank_env.update(ElasticEnv(job, len(sizes) - 1, tuple(sizes), tuple(lost),
                                       elastic.snapshot_every).as_env())
            bind = bind_address(job_hosts(), os.environ.get("HYDRA_IFACE"))
            with JobMonitor(size, timeout=options.timeout, report_dir=options.report_dir,
                            secret=secret, bind=bind, rerun_hint=False) as monitor:
                argv = launch_command(options, size, mpiexec, rank_env=rank_env)
                started = time.time()
                if launches:  # (the previous launch's relaunch)
                    launches[-1] = replace(launches[-1], relaunched=started)
                status = launch(argv)
                ended = time.time()
                monitor.finish(status)  # (a failure's summary; waits for the last closes)
            with monitor.lock:
                records = dict(monitor.records)
            # hosts lost in earlier launches whose last probe answered may be taken back
            answering = set(prober.answering()) if prober is not None else set()
            decision = decide(records, size, status, signals=tuple(monitor.signals),
                              sizes=sizes, options=elastic, capacity=capacity,
                              excluded=[item for item in lost
                                        if "/" not in item and item not in answering])
            vanished = vanished_records(records)
            lost_at = vanished[0].closed if vanished else None
            record = LaunchRecord(len(sizes) - 1, size, decision.hosts, status, decision,
                                  started, ended, lost_at)
            launches.append(record)
            if not decision.restart:
                if decision.message:
                    _say(decision.message)
                return ElasticResult(status, job, tuple(launches))
            if len(decision.hosts) > 1 or len(decision.survivors) > 1:
                # across hosts: the survivors' own host file
                if directory is None:
                    directory = tempfile.mkdtemp(prefix="mpistrat-elastic-")  # (0700)
                path = os.path.join(directory, "hosts")
                write_atomically(path, host_file_text(decision.survivors), mode=0o600)
                os.environ[_HOST_FILE] = path
            if os.environ.get("SLURM_JOB_ID"):  # a Slurm allocation (module docstring)
                os.environ[_OVERLAP] = "1"
            back = [host for host, _ in decision.survivors if host in answering]
            if back:
                _say(f"mpistrat run: {', '.join(back)}, lost before, "
                     f"answer{'s' if len(back) == 1 else ''} again: taken back")
                lost = [item for item in lost if item not in back]
            _say(f"{decision.message} after {time.time() - record.loss:.1f} s")
            sizes.append(decision.size)
            lost += decision.lost
            if prober is not None:
                prober.forget(back)
                prober.watch(decision.lost_hosts)
    finally:
        if prober is not None:
            prober.close()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        # the job is over, however it ended: its snapshots on this host go (a rerun is
        # another job; each host's writer deletes its own when the script ends well)
        remove_job(job)


def _say(text: str) -> None:
    sys.stdout.flush()
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
