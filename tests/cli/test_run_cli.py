"""``mpistrat run`` options, checked before MPI starts (CliRunner, one process)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from mpistrat.cli import cli
from mpistrat.cli.run import _end_options_at_module
from mpistrat.runner import RunOptions, launch_command
from mpistrat.runner.rank import RunSetupError


@pytest.fixture(autouse=True)
def _no_restart(monkeypatch):
    """A rank's 'mpistrat run' replaces its process to set the heap's huge-page tunable
    when MPI has not started yet (mpistrat.launch.hugepages): in this process that would
    restart pytest itself, whenever no earlier test happened to import mpi4py.MPI."""
    monkeypatch.setattr("mpistrat.launch.hugepages.restart_with_hugepages", lambda: None)


def _invoke(*args, env=None):
    return CliRunner().invoke(cli, ["run", *args], env=env)


@pytest.mark.parametrize("args, message", [
    ([], "give the script to run"),
    (["--bogus", "x.py"], "No such option '--bogus'"),
    (["--local-replicas", "2", "--gpus-per-rank", "1", "x.py"], "exclude each other"),
    (["--spec", "ringg", "x.py"], "--spec ringg: entry 0 'ringg': unknown all-reduce algorithm"),
    (["--spec", "@/no/such.spec", "x.py"], "--spec @/no/such.spec"),
    (["--communication", "mpi", "x.py"], "'mpi' is not one of 'auto', 'ring', 'nccl'"),
    (["--timeout", "0", "x.py"], "--timeout"),
    (["--stall-check", "-1", "x.py"], "--stall-check"),
    (["--num-packs", "-1", "x.py"], "--num-packs"),
    (["--mpiexec", "/bin/true", "x.py"], "--mpiexec goes with -n N"),
    (["-n", "0", "x.py"], "-n"),
    (["-n", "2", "no/such/script.py"], "script 'no/such/script.py' not found"),
    (["--torch-backend", "nccl", "x.py"], "'nccl' is not one of 'mpistrat', 'gloo'"),
])
def test_bad_options_exit_2_with_the_fix(args, message):
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_help_lists_the_options():
    result = _invoke("--help")
    assert result.exit_code == 0
    for option in ("--spec", "--num-packs", "--communication", "--local-replicas",
                   "--gpus-per-rank", "--tag-output", "--quiet-ranks", "--timeout",
                   "--stall-check", "-n, --np", "-m, --module", "--torch-backend"):
        assert option in result.output
    assert "mpistrat run -n 2 train.py" in result.output


def test_bad_environment_value_warns_and_uses_the_default(tmp_path, monkeypatch):
    """MPISTRAT_STALL_CHECK is read at the CLI edge; a typo is a warning, not a failure."""
    captured = {}
    monkeypatch.setattr("mpistrat.runner.launch_command",
                        lambda options, n, mpiexec: captured.setdefault("o", options) and [])
    monkeypatch.setattr("mpistrat.runner.self_launch", lambda argv: 0)
    script = tmp_path / "x.py"
    script.write_text("")
    with pytest.warns(RuntimeWarning, match="MPISTRAT_STALL_CHECK='soon'"):
        result = _invoke("-n", "2", str(script), env={"MPISTRAT_STALL_CHECK": "soon",
                                                      "MPISTRAT_COLLECTIVE_TIMEOUT": "30"})
    assert result.exit_code == 0, result.output
    assert captured["o"].stall_check == 60.0 and captured["o"].timeout == 30.0


def test_options_round_trip_through_the_relaunch_command(monkeypatch):
    options = RunOptions(target="train.py", args=("--lr", "0.1", "-n", "3"), spec="xring",
                         num_packs=2, communication="ring", local_replicas=2,
                         tag_output=True, quiet_ranks=True, timeout=30.0, stall_check=5.0)
    argv = options.command_line()
    assert argv[-5:] == ["train.py", "--lr", "0.1", "-n", "3"]
    seen = {}
    monkeypatch.setattr("mpistrat.runner.run", lambda o: seen.setdefault("options", o) and 7)
    result = CliRunner().invoke(cli, ["run", *argv])
    assert result.exit_code == 7, result.output
    assert seen["options"] == options
    module = RunOptions(target="pkg.mod", module=True, args=("-x",))
    assert module.command_line()[-3:] == ["-m", "pkg.mod", "-x"]


@pytest.mark.parametrize("args, env, expected", [
    ([], {}, None),
    ([], {"MPISTRAT_TORCH_BACKEND": "mpistrat"}, "mpistrat"),
    (["--torch-backend", "gloo"], {"MPISTRAT_TORCH_BACKEND": "mpistrat"}, "gloo"),
    (["--torch-backend", "MPISTRAT"], {}, "mpistrat"),
])
def test_torch_backend_and_its_environment_default(monkeypatch, args, env, expected):
    seen: dict[str, RunOptions] = {}
    monkeypatch.setattr("mpistrat.runner.run", lambda o: seen.setdefault("options", o) and 0)
    result = _invoke(*args, "x.py", env={"MPISTRAT_TORCH_BACKEND": None, **env})
    assert result.exit_code == 0, result.output
    assert seen["options"].torch_backend == expected
    assert seen["options"] == RunOptions(target="x.py", torch_backend=expected)
    relaunched = seen["options"].command_line()
    assert (["--torch-backend", expected] == relaunched[-3:-1]) == (expected is not None)


def test_a_bad_torch_backend_in_the_environment_is_a_usage_error():
    result = _invoke("x.py", env={"MPISTRAT_TORCH_BACKEND": "nccl"})
    assert result.exit_code == 2
    assert ("--torch-backend must be one of mpistrat, gloo, got 'nccl' (from "
            "MPISTRAT_TORCH_BACKEND)") in result.output


def test_launch_command_uses_the_matching_mpiexec(tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details: MPICH'\n")
    fake.chmod(0o755)
    argv = launch_command(RunOptions(target="t.py", args=("a",)), 3, str(fake), env={},
                          python="/py")
    assert argv[0] == str(fake) and argv[argv.index("-n") + 1] == "3"
    assert argv[argv.index("-n") + 2:] == ["/py", "-m", "mpistrat", "run", "--stall-check",
                                           "60.0", "t.py", "a"]
    with pytest.raises(RunSetupError, match="already running under .* with 4 ranks"):
        launch_command(RunOptions(target="t.py"), 2, str(fake),
                       env={"PMI_SIZE": "4", "PMI_RANK": "0"})


@pytest.mark.parametrize("args, expected", [
    (["-m", "pkg.mod", "--lr", "1"], ["-m", "pkg.mod", "--", "--lr", "1"]),
    (["--spec", "-m", "-mpkg", "-x"], ["--spec", "-m", "-mpkg", "--", "-x"]),
    (["--tag-output", "script.py", "-m", "x"], ["--tag-output", "script.py", "-m", "x"]),
    (["--", "-m", "x"], ["--", "-m", "x"]),
    (["--torch-backend", "mpistrat", "-m", "x", "-y"],
     ["--torch-backend", "mpistrat", "-m", "x", "--", "-y"]),
])
def test_options_end_at_the_module(args, expected):
    assert _end_options_at_module(args) == expected
