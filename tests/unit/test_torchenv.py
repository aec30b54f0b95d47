"""torchrun's variables under ``mpistrat run`` (mpistrat.runner.torchenv), on a world of
one rank in this process, and the pure parts (the error text, the address choice) for
larger jobs."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

import pytest

from mpistrat.config import RUN_MASTER
from mpistrat.errors import RunSetupError
from mpistrat.runner import RunOptions, run
from mpistrat.runner import torchenv
from mpistrat.runner.torchenv import (
    TORCH_ENV,
    _disagreements,
    _mismatch_text,
    free_port,
    master_address,
    restore_env,
    set_torch_env,
)


def test_every_variable_is_set_from_mpi_and_undone():
    environ: dict[str, str] = {"PATH": "/bin"}
    saved = set_torch_env(environ=environ)
    # (and the marker that the address is mpistrat run's: torch's store then runs over MPI)
    assert set(saved) == {*TORCH_ENV, RUN_MASTER} and all(v is None for v in saved.values())
    assert environ[RUN_MASTER] == f"127.0.0.1:{environ['MASTER_PORT']}"
    assert {name: environ[name] for name in TORCH_ENV if name != "MASTER_PORT"} == {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1"}
    assert 0 < int(environ["MASTER_PORT"]) < 65536
    restore_env(saved, environ)
    assert environ == {"PATH": "/bin"}


def test_the_users_values_are_kept_and_empty_ones_replaced():
    environ = {"RANK": "0", "WORLD_SIZE": " 1", "LOCAL_RANK": "5", "MASTER_ADDR": "10.1.2.3",
               "MASTER_PORT": "29500", "GROUP_RANK": ""}
    before = dict(environ)
    saved = set_torch_env(environ=environ)
    assert "RANK" not in saved and "MASTER_PORT" not in saved and saved["GROUP_RANK"] == ""
    assert RUN_MASTER not in environ  # the user's address: torch's own store
    assert environ["LOCAL_RANK"] == "5" and environ["MASTER_ADDR"] == "10.1.2.3"
    assert environ["MASTER_PORT"] == "29500" and environ["GROUP_RANK"] == "0"
    assert environ["WORLD_SIZE"] == " 1" and environ["LOCAL_WORLD_SIZE"] == "1"
    restore_env(saved, environ)
    assert environ == before


@pytest.mark.parametrize("name, value, message", [
    ("RANK", "1", "RANK='1' is set in the environment of the rank MPI numbers 0 (of 1)"),
    ("RANK", "zero", "RANK='zero'"),
    ("WORLD_SIZE", "2", "WORLD_SIZE='2' is set in the environment of every rank, but MPI's "
                        "world size is 1"),
])
def test_a_rank_or_size_that_is_not_mpis_stops_the_job(name, value, message):
    environ = {name: value}
    with pytest.raises(RunSetupError, match="unset them") as caught:
        set_torch_env(environ=environ)
    assert message in str(caught.value)
    assert environ == {name: value}  # nothing set


def test_mismatch_text_groups_the_ranks():
    size = 4
    found = [_disagreements({"RANK": "0", "WORLD_SIZE": "8"}, r, size) for r in range(size)]
    assert found[0] == (("WORLD_SIZE", "8"),)
    assert _mismatch_text(found) == (
        "WORLD_SIZE='8' is set in the environment of every rank, but MPI's world size is 4; "
        "RANK='0' is set in the environment of the ranks MPI numbers 1, 2, 3 (of 4)")
    only = [(), (("WORLD_SIZE", "3"),), (), ()]
    assert _mismatch_text(only) == ("WORLD_SIZE='3' is set in the environment of MPI "
                                    "rank(s) 1, but MPI's world size is 4")
    assert _mismatch_text([(), ()]) is None
    many = [(("RANK", "0"),)] * 7
    assert "MPI numbers 0, 1, 2, 3 and 3 more (of 7)" in str(_mismatch_text(many))


def _routes(table):
    return lambda addresses: list(dict.fromkeys(table[a] for a in addresses if a in table))


def test_master_address_is_where_the_routes_to_every_host_leave_from():
    ours = ["10.0.0.1", "192.168.9.1", "172.17.0.1"]
    routes = _routes({"10.0.0.2": "10.0.0.1", "10.0.0.3": "10.0.0.1",
                      "192.168.9.2": "192.168.9.1", "192.168.9.3": "192.168.9.1",
                      "8.8.8.8": "10.0.0.1"})
    pick: dict[str, Any] = dict(ours=ours, routes=routes, hostname=lambda: "node1")
    # every host on one network; docker0's 172.17.0.1, on every host, tells nothing
    assert master_address([["10.0.0.2", "172.17.0.1"], ["10.0.0.3", "172.17.0.1"]],
                          **pick) == "10.0.0.1"
    # two networks that reach every host: either will do, the first host's order decides
    assert master_address([["10.0.0.2", "192.168.9.2"], ["192.168.9.3", "10.0.0.3"]],
                          **pick) == "10.0.0.1"
    # no one address reaches both: the host name, for them to resolve
    assert master_address([["10.0.0.2"], ["192.168.9.3"]], **pick) == "node1"
    # a host that told nothing routable leaves the choice to the others
    assert master_address([["127.0.1.1"], ["192.168.9.3"]], **pick) == "192.168.9.1"
    assert master_address([], **pick) == "node1"


def test_master_address_of_an_interface(monkeypatch):
    monkeypatch.setattr(torchenv, "interface_address",
                        lambda name: "10.9.9.9" if name == "ib0" else None)
    kw: dict[str, Any] = dict(ours=[], routes=lambda a: ["10.0.0.1"], hostname=lambda: "node1")
    assert master_address([["10.0.0.2"]], interface="ib0", **kw) == "10.9.9.9"
    assert master_address([["10.0.0.2"]], interface="nope0", **kw) == "10.0.0.1"


def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", port))


def test_torch_backend_option_is_validated_and_relaunched():
    assert RunOptions(target="t.py").torch_backend is None
    assert RunOptions(target="t.py", torch_backend="mpistrat").command_line()[-3:] == [
        "--torch-backend", "mpistrat", "t.py"]
    with pytest.raises(ValueError, match="--torch-backend must be one of mpistrat, gloo"):
        RunOptions(target="t.py", torch_backend="nccl")


def test_mpistrat_backend_without_torch_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # (import torch fails, find_spec: None)
    with pytest.raises(RunSetupError, match=r"pip install 'mpistrat\[torch\]'") as caught:
        torchenv.use_mpistrat_backend()
    assert "--torch-backend mpistrat needs mpistrat.torch: PyTorch is not installed" \
        in str(caught.value)


def test_run_sets_the_variables_for_the_script_only(tmp_path):
    out = tmp_path / "seen.txt"
    script = tmp_path / "script.py"
    script.write_text("import os, sys\n"
                      f"names = {list(TORCH_ENV)!r}\n"
                      f"open({str(out)!r}, 'w').write(repr([os.environ.get(n) for n in names]"
                      f" + ['torch' in sys.modules]))\n")
    before = {name: os.environ.get(name) for name in TORCH_ENV}
    if any(v is not None for v in before.values()):
        pytest.skip("torchrun's variables are set in this test's environment")
    torch_loaded = "torch" in sys.modules
    assert run(RunOptions(target=str(script)), strategy_factory=None, env={}) == 0
    seen = eval(out.read_text())  # noqa: S307 - our own file
    assert seen[:9] == ["0", "1", "0", "1", "0", "1", "0", "1", "127.0.0.1"]
    assert seen[-1] == torch_loaded  # (mpistrat run imports no torch for this)
    assert {name: os.environ.get(name) for name in TORCH_ENV} == before


def test_run_refuses_a_users_rank_before_the_script(tmp_path, monkeypatch):
    script = tmp_path / "script.py"
    script.write_text("raise SystemExit('the script ran')\n")
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(RunSetupError, match="RANK='3'"):
        run(RunOptions(target=str(script)), strategy_factory=None, env={})
