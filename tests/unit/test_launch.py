"""Launcher detection and mpiexec command lines (pure: environments are plain dicts)."""

from __future__ import annotations

import os
import sys

import pytest

from mpistrat.errors import MpistratError
from mpistrat.launch.env import LaunchInfo, detect
from mpistrat.launch.mpiexec import Launcher, find_launcher


@pytest.mark.parametrize("env, expected", [
    ({}, LaunchInfo(None, None, None)),
    ({"PMI_SIZE": "4", "PMI_RANK": "2"}, LaunchInfo("MPICH Hydra / PMI", 4, 2)),
    ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0", "PMIX_RANK": "0"},
     LaunchInfo("Open MPI (prterun/mpirun)", 3, 0)),
    ({"SLURM_NTASKS": "8", "SLURM_PROCID": "5"}, LaunchInfo("Slurm srun", 8, 5)),
    ({"PMI_SIZE": "x"}, LaunchInfo("MPICH Hydra / PMI", None, None)),
])
def test_detect(env, expected):
    assert detect(env) == expected


def test_mismatch_names_the_cause_and_fix():
    info = detect({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"})
    message = info.mismatch(mpi_size=1)
    assert "started 4 processes" in message and "rank 0 of 1" in message
    assert "mpiexec" in message and "srun --mpi=pmi2" in message
    assert info.mismatch(mpi_size=4) is None
    assert detect({}).mismatch(mpi_size=1) is None


def test_mpich_argv_passes_environment_with_genv():
    argv = Launcher("/x/mpiexec", "mpich").argv(3, ["python", "s.py"], env={"A": "1"})
    assert argv == ["/x/mpiexec", "-genv", "A", "1", "-n", "3", "python", "s.py"]


@pytest.mark.parametrize("as_root, extra", [(True, ["--allow-run-as-root"]), (False, [])])
def test_openmpi_argv_oversubscribes_and_allows_root(as_root, extra):
    argv = Launcher("/x/mpirun", "openmpi").argv(4, ["prog"], env={"B": "2"}, as_root=as_root)
    assert argv == ["/x/mpirun", "--oversubscribe", *extra, "-x", "B=2", "-n", "4", "prog"]


def test_argv_rejects_zero_ranks():
    with pytest.raises(ValueError, match="nprocs must be >= 1, got 0"):
        Launcher("/x/mpiexec", "mpich").argv(0, ["prog"])


def test_explicit_path_that_is_not_executable_is_a_clear_error(tmp_path):
    missing = str(tmp_path / "no-mpiexec")
    with pytest.raises(MpistratError, match="--mpiexec names .*not an executable"):
        find_launcher(missing, environ={})
    with pytest.raises(MpistratError, match="MPISTRAT_MPIEXEC names"):
        find_launcher(environ={"MPISTRAT_MPIEXEC": missing})


def test_finds_the_launcher_of_this_environment():
    launcher = find_launcher(environ={})
    assert os.access(launcher.path, os.X_OK)
    assert launcher.flavour in ("mpich", "openmpi")
    # with the wheel from PyPI it sits beside this Python
    if os.path.exists(os.path.join(os.path.dirname(sys.executable), "mpiexec")):
        assert os.path.dirname(launcher.path) == os.path.dirname(sys.executable)
