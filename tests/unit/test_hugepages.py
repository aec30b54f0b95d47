"""When ``mpistrat run`` / ``bench`` restart with glibc's malloc on transparent huge pages
(:mod:`mpistrat.launch.hugepages`): only where it helps, once, and never against the
user's own setting."""

from __future__ import annotations

import pytest

from mpistrat.launch import hugepages
from mpistrat.launch.hugepages import describe_heap, malloc_hugepages_env, thp_mode

NEW = (2, 36)


THRESHOLDS = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=67108864"


def test_adds_the_tunables_on_glibc_235_with_thp_madvise():
    assert malloc_hugepages_env({}, mode="madvise", glibc=(2, 35)) == {
        "GLIBC_TUNABLES": f"glibc.malloc.hugetlb=1:{THRESHOLDS}"}
    # other tunables are kept, the new ones appended
    assert malloc_hugepages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
                                mode="madvise", glibc=NEW) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1:{THRESHOLDS}"}


@pytest.mark.parametrize("environ, expected", [
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"},
     "glibc.malloc.mmap_threshold=131072:glibc.malloc.hugetlb=1"
     ":glibc.malloc.trim_threshold=67108864"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
     "glibc.malloc.trim_threshold=0:glibc.malloc.hugetlb=1"
     ":glibc.malloc.mmap_threshold=33554432"),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"},
     "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=67108864"),
    ({"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"},
     "glibc.malloc.hugetlb=1"),
])
def test_a_threshold_the_user_set_is_kept(environ, expected):
    """malloc's thresholds are fixed at the values its sliding ones reach, unless the user
    chose one, through the tunable or glibc's older variable."""
    assert malloc_hugepages_env(environ, mode="madvise", glibc=NEW) == {
        "GLIBC_TUNABLES": expected}


@pytest.mark.parametrize("environ, mode, glibc", [
    ({}, "always", NEW),  # huge pages anyway
    ({}, "never", NEW),  # none to be had
    ({}, None, NEW),  # no THP (or not Linux)
    ({}, "madvise", (2, 34)),  # glibc before the tunable
    ({}, "madvise", None),  # not glibc (musl, macOS)
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", NEW),  # the user's choice
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "madvise", NEW),  # after the restart
    ({"GLIBC_TUNABLES": "a=1: glibc.malloc.hugetlb=2"}, "madvise", NEW),
    ({"MPISTRAT_MALLOC_HUGEPAGES": "0"}, "madvise", NEW),
    ({"MPISTRAT_MALLOC_HUGEPAGES": "off"}, "madvise", NEW),
])
def test_nothing_to_change(environ, mode, glibc):
    assert malloc_hugepages_env(environ, mode=mode, glibc=glibc) is None


@pytest.mark.parametrize("value", ["1", "auto", "on", ""])
def test_on_and_auto_both_restart(value):
    environ = {"MPISTRAT_MALLOC_HUGEPAGES": value}
    assert malloc_hugepages_env(environ, mode="madvise", glibc=NEW) is not None


def test_a_bad_setting_warns_and_counts_as_auto():
    with pytest.warns(RuntimeWarning, match="MPISTRAT_MALLOC_HUGEPAGES='maybe'.*=0"):
        assert malloc_hugepages_env({"MPISTRAT_MALLOC_HUGEPAGES": "maybe"}, mode="madvise",
                                    glibc=NEW) is not None


def test_thp_mode_reads_the_bracketed_choice(tmp_path):
    path = tmp_path / "enabled"
    path.write_text("always [madvise] never\n")
    assert thp_mode(str(path)) == "madvise"
    path.write_text("[always] madvise never\n")
    assert thp_mode(str(path)) == "always"
    assert thp_mode(str(tmp_path / "missing")) is None


def test_no_restart_once_mpi_is_imported(monkeypatch):
    """A process whose MPI may have started is never replaced (its launcher would see a
    second start)."""
    monkeypatch.setattr(hugepages, "malloc_hugepages_env", lambda: {"GLIBC_TUNABLES": "x"})
    monkeypatch.setitem(__import__("sys").modules, "mpi4py.MPI", object())
    calls = []
    monkeypatch.setattr(hugepages.os, "execve", lambda *a: calls.append(a))
    hugepages.restart_with_hugepages()
    assert calls == []


def test_restart_runs_the_same_command_line(monkeypatch):
    import sys

    monkeypatch.setattr(hugepages, "malloc_hugepages_env",
                        lambda: {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    monkeypatch.setattr(sys, "orig_argv", ["python3", "-m", "mpistrat", "run", "t.py", "a b"])
    calls = []
    monkeypatch.setattr(hugepages.os, "execve", lambda *a: calls.append(a))
    hugepages.restart_with_hugepages()
    (path, argv, env), = calls
    assert path == sys.executable
    assert argv == [sys.executable, "-m", "mpistrat", "run", "t.py", "a b"]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


def test_describe_heap():
    assert "huge pages" in describe_heap("glibc.malloc.hugetlb=1", "madvise")
    assert "huge pages" in describe_heap(None, "always")
    assert describe_heap(None, "madvise") == "arrays under 4 MiB on 4 KiB pages (THP madvise)"


def test_self_launched_ranks_are_handed_the_tunable(monkeypatch):
    """``mpistrat run -n`` passes the tunable with the launcher's flags (so the ranks
    need not start twice); the monitor's address stays in the environment (hydra passes
    it on; tests/unit/test_control_plane.py); nothing when there is no tunable to add."""
    import shutil
    import sys
    from pathlib import Path

    from mpistrat.runner.launch import launch_command
    from mpistrat.runner.options import RunOptions

    launcher = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or \
        shutil.which("mpiexec")
    if launcher is None:
        pytest.skip("no mpiexec (the mpich wheel provides one)")
    options = RunOptions(target="train.py")
    env = {"MPISTRAT_RUN_MONITOR": "1 host 10.0.0.1", "PATH": ""}
    tunable = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    monkeypatch.setattr("mpistrat.runner.launch.malloc_hugepages_env", lambda environ: tunable)
    argv = launch_command(options, 2, mpiexec=launcher, env=env)
    text = " ".join(argv)
    assert "GLIBC_TUNABLES" in text and "glibc.malloc.hugetlb=1" in text, argv
    assert "MPISTRAT_RUN_MONITOR" not in text and "10.0.0.1" not in text, argv
    monkeypatch.setattr("mpistrat.runner.launch.malloc_hugepages_env", lambda environ: None)
    argv = launch_command(options, 2, mpiexec=launcher, env=env)
    assert "GLIBC_TUNABLES" not in " ".join(argv), argv
