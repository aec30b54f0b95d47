"""A real ``mpistrat run -n 2`` job with an attacker beside it: someone who found the job
monitor's port connects, forges hellos and ends (one of them the line that used to make
``mpistrat run`` end a healthy job 35 s later with a false "lost host"), sends the line
that stopped the old monitor's thread, a rank outside the job, a megabyte line and a
thousand connections. The job ends with its own status and its own account; the job's
secret is on no process's command line and not in the script's environment."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.launch

# rank 0 tells the test where the monitor listens (an attacker reads it off the network
# or a process list), then both ranks wait for the test's 'go'; then rank 1 either dies
# without a word (mode 'crash') or both finish (mode 'healthy').
SCRIPT = textwrap.dedent("""\
    import os, sys, time
    import numpy as np
    import mpistrat
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    here, mode = sys.argv[1], sys.argv[2]
    assert "MPISTRAT_JOB_SECRET" not in os.environ, "the secret reached the script"
    if comm.rank == 0:
        with open(os.path.join(here, "monitor.tmp"), "w") as f:
            f.write(os.environ["MPISTRAT_RUN_MONITOR"])
        os.rename(os.path.join(here, "monitor.tmp"), os.path.join(here, "monitor"))
    while not os.path.exists(os.path.join(here, "go")):
        time.sleep(0.05)
    mpistrat.all_reduce(np.ones(3), comm=comm)
    if mode == "crash" and comm.rank == 1:
        os._exit(7)
    mpistrat.all_reduce(np.ones(3), comm=comm)
    print(f"rank {comm.rank} finished", flush=True)
    """)


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)
    return path.read_text()


def _attack(port: int) -> int:
    """Everything an attacker without the secret can send; the number of connections."""
    def connect():
        return socket.create_connection(("127.0.0.1", port), timeout=5)

    sent = 0
    for line in (b"hello 1 node1 999\n",  # the forged hello of the old protocol
                 "hello ² h 1\n".encode(),  # stopped the old monitor's thread
                 b"hello 7 node1 999 " + b"0" * 64 + b"\n",  # a rank >= size
                 b"hello 1 \x1b[2Jnode9 999 " + b"f" * 64 + b"\n"):
        with connect() as sock:
            sock.sendall(line)
            sock.sendall(b"end 1\n")
            sent += 1
    with connect() as sock:
        try:
            sock.sendall(b"y" * (1 << 20))  # a megabyte without a newline
        except OSError:
            pass
        sent += 1
    held = []
    try:
        for _ in range(1000):
            held.append(connect())
            sent += 1
    finally:
        for sock in held:
            sock.close()
    return sent


def _secret_on_a_command_line(secret: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as file:
                    if secret.encode() in file.read():
                        found.append(pid)
            except OSError:
                pass
    return found


@pytest.mark.parametrize("mode", ["healthy", "crash"])
def test_a_forging_client_changes_nothing_about_the_jobs_end(tmp_path, mode):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    process = subprocess.Popen(
        [sys.executable, "-m", "mpistrat", "run", "-n", "2", str(script), str(tmp_path), mode],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        address = _wait_for(tmp_path / "monitor", process)
        port, host, addresses = address.split()
        assert addresses == "127.0.0.1"  # a job on this host alone: the loopback only
        # mpiexec's environment holds it (readable by the job's user only)
        with open(f"/proc/{process.pid}/task/{process.pid}/children") as file:
            mpiexec = file.read().split()[0]
        with open(f"/proc/{mpiexec}/environ", "rb") as file:
            environ = dict(item.split(b"=", 1) for item in file.read().split(b"\0") if item)
        secret = environ[b"MPISTRAT_JOB_SECRET"].decode()
        assert len(secret) == 64
        assert _secret_on_a_command_line(secret) == []
        sent = _attack(int(port))
        (tmp_path / "go").write_text("")
        out, err = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait()
    assert "node9" not in err and "\x1b" not in err
    refused = re.search(r"the job monitor refused (\d+) message\(s\)", err)
    assert refused, err
    # (all but those still waiting for a hello when the attacker closed them: at most 64)
    assert int(refused.group(1)) >= sent - 64 - 8
    if mode == "healthy":
        assert process.returncode == 0, out + err
        assert "rank 0 finished" in out and "rank 1 finished" in out
        assert "without a report" not in err and "lost" not in err, err
    else:
        # the job's own account: rank 1 of this host ended first, not a forged rank 1
        # of node1, nor a rank 7; and the monitor lived to say it
        assert process.returncode == 7, out + err
        hostname = socket.gethostname()
        assert f"without a report were every rank of host {hostname} (ranks 0, 1): rank 1 " \
            "at " in err, err
        assert "node1" not in err
