"""What the tests of this directory share besides the fixtures: whether this process may
build clusters, polling with a bound, the processes of a host, a job run under a launcher,
and Slurm's commands and slurmd on the hosts. (Imported as ``_cluster``: a helper module of its
own, since ``from conftest import`` could find another directory's conftest.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def unavailable() -> str | None:
    """Why no cluster can be built here, or None."""
    if not sys.platform.startswith("linux"):
        return f"bin/cluster-local needs Linux namespaces, not {sys.platform}"
    if os.environ.get("MPISTRAT_CLUSTER_UNAVAILABLE"):
        return os.environ["MPISTRAT_CLUSTER_UNAVAILABLE"]
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run the tests as root, as CI does)"
    return None


def give_up(reason: str):
    """Skip with the reason, or fail with MPISTRAT_CLUSTER_REQUIRED=1 (CI as root)."""
    if os.environ.get("MPISTRAT_CLUSTER_REQUIRED") == "1":
        pytest.fail(f"multi-host tests required (MPISTRAT_CLUSTER_REQUIRED=1) but: {reason}",
                    pytrace=False)
    pytest.skip(reason)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1, explain=None):
    """Poll ``predicate`` until it is true; fail naming ``what`` after ``timeout`` s (and
    what ``explain()`` then says, if given)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not after {timeout} s" +
                        (f"; {explain()}" if explain is not None else ""))
        time.sleep(interval)


def processes(cluster, host: str) -> dict[int, str]:
    """pid -> command line of every process on ``host`` (its network namespace)."""
    namespace = f"{cluster.control['CLUSTER_LOCAL_NAME']}-{host}"
    listed = subprocess.run(["ip", "netns", "pids", namespace],
                            capture_output=True, text=True, timeout=30, check=False)
    found = {}
    for pid in map(int, listed.stdout.split()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                found[pid] = file.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def script_ranks(cluster, host: str, script: str) -> list[int]:
    """The ranks running ``script`` (a file name) on ``host``: Python processes whose
    command line names it (not the batch script or srun, whose command lines name it
    too)."""
    return [pid for pid, cmd in processes(cluster, host).items()
            if script in cmd and os.path.basename(cmd.split()[0]).startswith("python")]


def leftovers(cluster, script: str, also: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """A job's processes still on each host: those naming ``script``, hydra's proxies,
    slurmstepd, and those naming any of ``also``."""
    left = {}
    for host in cluster.hosts:
        cmds = [cmd for cmd in processes(cluster, host).values()
                if any(word in cmd for word in (script, "hydra_pmi_proxy", "slurmstepd",
                                                *also))]
        if cmds:
            left[host] = cmds
    return left


def kill_host(cluster, host: str, keep_slurmd: bool = True) -> None:
    """SIGKILL every process of ``host`` (but its slurmd, which the Slurm tests need,
    unless ``keep_slurmd`` is False)."""
    for pid, cmd in processes(cluster, host).items():
        if keep_slurmd and cmd.startswith("slurmd "):
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Job:
    """A job under a launcher, its output to files (no pipe can fill up), run from
    ``cwd`` with the cluster's environment and ``env``. As a context manager it ends,
    when the block does, the launcher and whatever it left on the cluster's hosts."""

    def __init__(self, cluster, argv, tmp_path: Path, cwd: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.cluster = cluster
        self.out, self.err = tmp_path / "job.out", tmp_path / "job.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(
                [str(a) for a in argv], cwd=cwd or ROOT, env={**cluster.env, **(env or {})},
                stdout=out, stderr=err, start_new_session=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for host in self.cluster.hosts:
            kill_host(self.cluster, host)

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        """Poll ``predicate`` until it holds; fail naming ``what`` if the job ends first
        or after ``timeout`` seconds."""
        wait_until(lambda: predicate() or self.process.poll() is not None, timeout, what)
        assert self.process.poll() is None, f"the job ended before {what}:\n{self.output}"

    @property
    def output(self) -> str:
        return self.out.read_text() + self.err.read_text()


# -- Slurm on the cluster's hosts (the slurm_cluster fixture)


def slurm_env(cluster) -> dict[str, str]:
    """The environment of Slurm commands: inside a Slurm job, mpiexec must start its
    proxies through Slurm, not hydra's ssh stand-in."""
    return {k: v for k, v in cluster.env.items() if not k.startswith("HYDRA_")}


def slurm(cluster, *argv, timeout=60) -> subprocess.CompletedProcess:
    """Run a Slurm command (sbatch, scontrol, sinfo, ...) from the checkout."""
    return subprocess.run([str(a) for a in argv], cwd=ROOT, env=slurm_env(cluster),
                          capture_output=True, text=True, timeout=timeout, check=False)


def job_fields(cluster, job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields."""
    return dict(re.findall(r"(\w+)=(\S*)", slurm(cluster, "scontrol", "show", "job", "-o",
                                                  job_id).stdout))


def node_state(cluster, node: str) -> str:
    """``sinfo``'s short state of ``node`` (idle, alloc, down*, ...)."""
    return slurm(cluster, "sinfo", "-h", "-n", node, "-o", "%t").stdout.strip()


def slurmd_running(cluster, node: str) -> bool:
    return any(cmd.startswith("slurmd ") for cmd in processes(cluster, node).values())


def stop_slurmd(cluster, node: str) -> None:
    """SIGTERM ``node``'s slurmd and wait until it has exited (its jobs' processes stay)."""
    for pid, cmd in processes(cluster, node).items():
        if cmd.startswith("slurmd "):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    wait_until(lambda: not slurmd_running(cluster, node), 30, f"{node}'s slurmd stopped")


def restart_slurmd(cluster, node: str) -> None:
    """Start ``node``'s slurmd again as bin/cluster-local does (inside the host, pid in
    its pid file so that `cluster-local down` stops it), and wait until it is idle."""
    directory = Path(cluster.control["CLUSTER_LOCAL_DIR"])
    starts = []

    def start() -> None:
        starts.append(time.monotonic())
        with open(directory / "log" / f"slurmd-{node}.out", "a") as log:
            process = subprocess.Popen(
                ["bash", str(ROOT / "bin" / "cluster-local"), "exec", node, "slurmd", "-D",
                 "-N", node, "-f", str(directory / "etc" / "slurm.conf")],
                env=cluster.control, stdout=log, stderr=log, start_new_session=True)
        (directory / "run" / f"slurmd-{node}.pid").write_text(f"{process.pid}\n")

    if not slurmd_running(cluster, node):
        start()
    resumed = []

    def idle() -> bool:
        state = node_state(cluster, node)
        # A node slurmctld drained while its slurmd was gone ("Kill task failed", "Not
        # responding" on a slow machine) stays drained when slurmd registers again, whatever
        # ReturnToService says: resume it, as an administrator would after a reboot.
        if state.startswith(("drain", "drng")) and not resumed:
            resumed.append(_node_line(cluster, node))
            slurm(cluster, "scontrol", "update", f"NodeName={node}", "State=RESUME")
        # a slurmd that exited at once (its log says why) is started again, twice at most
        if state != "idle" and starts and len(starts) < 3 and \
                time.monotonic() - starts[-1] > 5 and not slurmd_running(cluster, node):
            start()
        return state == "idle"

    def explain() -> str:
        log = directory / "log"
        tails = "\n".join(f"--- {path.name}:\n" + "\n".join(
            path.read_text(errors="replace").splitlines()[-15:])
            for path in (log / "slurmctld.log", log / f"slurmd-{node}.log",
                         log / f"slurmd-{node}.out") if path.exists())
        neighbours = subprocess.run(
            ["ip", "-n", f"{cluster.control['CLUSTER_LOCAL_NAME']}-{node}", "neigh"],
            capture_output=True, text=True, timeout=30, check=False).stdout
        return (f"{_node_line(cluster, node)}"
                f"{'; resumed from ' + resumed[0] if resumed else ''}; slurmd started "
                f"{len(starts)} time(s)\n{node}'s neighbours: {neighbours}\n{tails}")

    wait_until(idle, 90, f"{node} idle again", explain=explain)


def _node_line(cluster, node: str) -> str:
    """``scontrol show node``'s state and reason of ``node``."""
    line = slurm(cluster, "scontrol", "show", "node", "-o", node).stdout
    state = re.search(r"\bState=(\S*)", line)
    reason = re.search(r"\bReason=(.*?)(?= \w+=|$)", line.strip())
    return (f"State={state.group(1) if state else '?'} "
            f"Reason={reason.group(1) if reason else ''!r}")
