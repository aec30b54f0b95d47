"""The pieces of ``mpistrat run`` in one process: rank tags, tagged and quiet output,
outcomes and tracebacks, and a whole run on a singleton world with a stand-in strategy."""

from __future__ import annotations

import io
import sys

import pytest

from mpistrat.errors import TopologyError
from mpistrat.runner import RunOptions, run
from mpistrat.runner.failure import Outcome, format_exception, outcome_of
from mpistrat.runner.output import RankOutput, TaggedWriter, rank_tag
from mpistrat.runner.rank import RunSetupError


@pytest.mark.parametrize("ranks, tag", [
    ([1], "[1] "), ([0, 1, 2], "[0-2] "), ([3, 0, 1, 5, 6, 7], "[0-1,3,5-7] "),
])
def test_rank_tag(ranks, tag):
    assert rank_tag(ranks) == tag


def test_tagged_writer_prefixes_whole_lines():
    out = io.StringIO()
    w = TaggedWriter(out, "[2] ")
    w.write("a")
    assert out.getvalue() == ""  # a partial line waits
    w.write("b\nc\nd")
    assert out.getvalue() == "[2] ab\n[2] c\n"
    w.flush()
    w.write("e\n\n")
    w.write("50%\r60%\r")
    assert out.getvalue() == "[2] ab\n[2] c\n[2] de\n[2] \n[2] 50%\r[2] 60%\r"
    with pytest.raises(TypeError):
        w.write(b"bytes")


def test_rank_output_tags_quiets_and_restores():
    real_out, real_err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = real_out, real_err
    try:
        with RankOutput(1, 3, tag=True) as output:
            print("hello")
            print("warn", file=sys.stderr)
            output.report("Traceback\n  line\nError: x")
        with RankOutput(2, 3, quiet=True) as output:
            print("silenced")
            output.report("but reports show")
        with RankOutput(0, 1, tag=True) as output:
            print("single rank: no tag")
            output.report("plain report", ranks=[0])
        assert (sys.stdout, sys.stderr) == (real_out, real_err)
    finally:
        sys.stdout, sys.stderr = saved
    assert real_out.getvalue() == "[1] hello\nsingle rank: no tag\n"
    assert real_err.getvalue() == ("[1] warn\n[1] Traceback\n[1]   line\n[1] Error: x\n"
                                   "[2] but reports show\nplain report\n")


def test_outcomes_follow_pythons_exit_rules():
    assert outcome_of(None, "t.py") == Outcome(0)
    assert outcome_of(SystemExit(), "t.py") == Outcome(0)
    assert outcome_of(SystemExit(0), "t.py") == Outcome(0)
    assert outcome_of(SystemExit(3), "t.py") == Outcome(
        3, "mpistrat run: t.py exited with status 3")
    assert outcome_of(SystemExit(256), "t.py").status == 1  # what the shell would see is 0
    assert outcome_of(SystemExit("bad input"), "t.py") == Outcome(1, "bad input")
    assert outcome_of(KeyboardInterrupt(), "t.py").status == 130
    failed = outcome_of(ValueError("v"), "t.py")
    assert failed.status == 1 and failed.report.endswith("ValueError: v\n")


def _raise_topology_error():
    from mpistrat.spec import parse_spec

    parse_spec("pscpu#0")


def test_tracebacks_hide_mpistrat_frames_below_the_call_for_its_own_errors():
    def script_line():
        try:
            _raise_topology_error()
        except Exception as exc:
            raise TopologyError("shown with the caller's frames only") from exc

    with pytest.raises(TopologyError) as info:
        script_line()
    text = format_exception(info.value)
    assert "The above exception was the direct cause" in text
    assert text.rstrip().endswith("TopologyError: shown with the caller's frames only")
    assert "in script_line" in text and "_raise_topology_error" in text
    cause = text.split("The above exception")[0]
    assert "mpistrat/spec.py" not in cause  # the SpecError's frames inside mpistrat: hidden


def test_whole_run_on_one_rank_with_a_stand_in_strategy(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint('args', sys.argv[1:], __name__)\n"
                      "import stand_in\nprint('strategy', stand_in.current)\n")
    (tmp_path / "stand_in.py").write_text("current = None\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import stand_in

        made = []

        def factory(options):
            made.append(options)
            return "the strategy"

        def set_strategy(strategy):
            stand_in.current = strategy

        options = RunOptions(target=str(script), args=("x",), stall_check=0)
        assert run(options, strategy_factory=factory, set_strategy=set_strategy, env={}) == 0
        assert made == [options] and stand_in.current is None  # reset after the script
        out = capsys.readouterr().out
        assert "args ['x'] __main__" in out and "strategy the strategy" in out

        failing = tmp_path / "f.py"
        failing.write_text("raise SystemExit(4)\n")
        assert run(RunOptions(target=str(failing)), strategy_factory=None, env={}) == 4
        assert "f.py exited with status 4" in capsys.readouterr().err

        def broken(options):
            raise ValueError("no such device")

        assert run(RunOptions(target=str(script)), strategy_factory=broken, env={}) == 1
        err = capsys.readouterr().err
        assert "could not create the default strategy from the options: ValueError: no " \
               "such device" in err
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("stand_in", None)


def test_setup_errors():
    with pytest.raises(RunSetupError, match="script 'nope.py' not found"):
        run(RunOptions(target="nope.py"), strategy_factory=None, env={})
    with pytest.raises(RunSetupError, match="no module named 'no_such_mod_xyz'"):
        run(RunOptions(target="no_such_mod_xyz", module=True), strategy_factory=None, env={})
    with pytest.raises(RunSetupError, match="started 4 processes but MPI sees a world of 1"):
        run(RunOptions(target="nope.py"), strategy_factory=None,
            env={"PMI_SIZE": "4", "PMI_RANK": "0"})
