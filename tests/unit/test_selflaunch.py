"""The one self-launch path of ``mpistrat run -n`` and ``mpistrat bench --np``: the
nesting rule and the signal forwarding both commands share."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from mpistrat.errors import RunSetupError
from mpistrat.launch.selflaunch import launch_argv, self_launch


@pytest.fixture
def fake_mpiexec(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details: MPICH'\n")
    fake.chmod(0o755)
    return str(fake)


@pytest.mark.parametrize("what, option", [("mpistrat run", "-n"), ("mpistrat bench", "--np")])
def test_both_commands_refuse_to_nest_under_a_launcher_of_several_ranks(fake_mpiexec, what,
                                                                        option):
    with pytest.raises(RunSetupError) as info:
        launch_argv(what, option, 2, ["/py", "x"], mpiexec=fake_mpiexec,
                    env={"PMI_SIZE": "4", "PMI_RANK": "1"})
    assert str(info.value) == (
        f"{what} {option} 2: already running under MPICH Hydra / PMI with 4 ranks; leave "
        f"out {option} (the launcher started the ranks)")


@pytest.mark.parametrize("env", [
    {},                                                     # a shell
    {"PMI_SIZE": "1", "PMI_RANK": "0"},                     # a launcher's single rank
    {"SLURM_NTASKS": "4", "SLURM_PROCID": "0"},             # a Slurm batch script
])
def test_both_commands_start_mpiexec_elsewhere(fake_mpiexec, env):
    argv = launch_argv("mpistrat bench", "--np", 3, ["/py", "-m", "mpistrat", "bench"],
                       mpiexec=fake_mpiexec, env=env)
    assert argv[0] == fake_mpiexec and argv[argv.index("-n") + 1] == "3"
    assert argv[-4:] == ["/py", "-m", "mpistrat", "bench"]


class _Watch:
    bound = 60.0

    def __init__(self) -> None:
        self.signals: list[int] = []

    def troubled(self) -> bool:
        return False

    def forwarded(self, signum: int) -> None:
        self.signals.append(signum)


@pytest.mark.parametrize("watch", [None, _Watch()], ids=["alone", "watched"])
def test_a_signal_reaches_the_launched_job_and_its_status_comes_back(tmp_path, watch):
    ready = tmp_path / "ready"
    child = ("import pathlib, signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
             f"pathlib.Path({str(ready)!r}).touch()\n"
             "time.sleep(60)\n")

    def terminate_us_once_the_child_listens():
        for _ in range(600):
            if ready.exists():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            threading.Event().wait(0.05)

    before = signal.getsignal(signal.SIGTERM)
    sender = threading.Thread(target=terminate_us_once_the_child_listens, daemon=True)
    sender.start()
    status = self_launch([sys.executable, "-c", child], watch)
    sender.join(5)
    assert status == 7  # the child got our SIGTERM (its handler's exit status)
    assert signal.getsignal(signal.SIGTERM) is before  # and our own handler is back
    if watch is not None:  # the job monitor learns that the launcher ends the ranks
        assert watch.signals == [signal.SIGTERM]


def test_a_job_killed_by_a_signal_reports_128_plus_its_number():
    assert self_launch([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"]) == 137
