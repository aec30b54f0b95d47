"""Unit tests for the all-reduce spec language (mpistrat.spec); single process, no MPI."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpistrat import algorithms
from mpistrat.errors import SpecError, SpecTypeError, UnknownAlgorithmError
from mpistrat.spec import (
    MAX_BYTES,
    MAX_SHARDS,
    AllReduceSpec,
    AllReduceSpecTuple,
    PlanRow,
    format_bytes,
    format_limit,
    parse_bytes,
    parse_spec,
)

T = AllReduceSpecTuple
K, M, G, TB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

EXPECTED_ALGORITHMS = {
    "nccl", "nccl/xring", "nccl/rechd", "nccl/pscpu",
    "xring", "rechd", "pscpu", "psgpu", "pscpu/pscpu", "native",
    "shm", "shm/xring", "shm/rechd", "shm/pscpu",
}


# ------------------------------------------------------------------ package / registry


def test_import_does_not_initialise_mpi():
    code = (
        "import sys, mpistrat, mpistrat.spec, mpistrat.layout\n"
        "mpistrat.parse_spec('nccl#2:1K:pscpu/pscpu#2')\n"
        "assert 'mpi4py.MPI' not in sys.modules, 'mpi4py.MPI imported'\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
        "frameworks = [m for m in ('torch', 'jax', 'array_api_compat', 'cloudpickle',\n"
        "                          'mpi4py.futures', 'mpistrat.ps.strategy')\n"
        "              if m in sys.modules]\n"
        "assert not frameworks, f'imported {frameworks}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_registry_holds_exactly_the_documented_algorithms():
    names = algorithms.names()
    assert set(names) == EXPECTED_ALGORITHMS
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", sorted(EXPECTED_ALGORITHMS))
def test_every_registered_name_parses_alone(name):
    assert parse_spec(name).entries == (T(name, 1, -1),)


def test_error_types_are_value_errors():
    assert issubclass(SpecError, ValueError)
    assert issubclass(SpecTypeError, SpecError)
    assert issubclass(SpecTypeError, TypeError)
    assert issubclass(UnknownAlgorithmError, SpecError)


# ------------------------------------------------------------------ accepted forms


ACCEPTED = [
    # Python forms, as TensorFlow takes them
    ("xring", (T("xring", 1, -1),)),
    (("xring",), (T("xring", 1, -1),)),
    (("pscpu", 2), (T("pscpu", 2, -1),)),
    (("pscpu", 2, -1), (T("pscpu", 2, -1),)),
    (T("nccl/xring", 3), (T("nccl/xring", 3, -1),)),
    (T("rechd"), (T("rechd", 1, -1),)),
    ([("xring", 2, -1)], (T("xring", 2, -1),)),
    ([("nccl", 1, 1024), ("xring", 2, -1)], (T("nccl", 1, 1024), T("xring", 2, -1))),
    ([T("nccl", 1, 0), T("rechd", 1, 4096), T("pscpu/pscpu", 2, -1)],
     (T("nccl", 1, 0), T("rechd", 1, 4096), T("pscpu/pscpu", 2, -1))),
    ([("nccl", 1, 1024), ("native",)], (T("nccl", 1, 1024), T("native", 1, -1))),
    ([("nccl", 1, "1K"), ("xring", 1, "-1")], (T("nccl", 1, 1024), T("xring", 1, -1))),
    # tf_cnn_benchmarks grammar alg[#shards][:limit:alg[#shards]]...
    ("nccl#2:1K:pscpu/pscpu#2", (T("nccl", 2, 1024), T("pscpu/pscpu", 2, -1))),
    ("nccl#2", (T("nccl", 2, -1),)),
    ("nccl:1024:xring", (T("nccl", 1, 1024), T("xring", 1, -1))),
    ("xring#2:4M:rechd:1G:pscpu#4",
     (T("xring", 2, 4 * M), T("rechd", 1, G), T("pscpu", 4, -1))),
    ("nccl:0:xring", (T("nccl", 1, 0), T("xring", 1, -1))),
    ("nccl:32KiB:xring", (T("nccl", 1, 32 * K), T("xring", 1, -1))),
    ("nccl:32kb:xring", (T("nccl", 1, 32 * K), T("xring", 1, -1))),
    ("nccl:1T:xring", (T("nccl", 1, TB), T("xring", 1, -1))),
    (" nccl # 2 : 1K : xring ", (T("nccl", 2, 1024), T("xring", 1, -1))),
    # comma form alg:shards:limit,...
    ("nccl:2:1024,pscpu/pscpu:2:-1", (T("nccl", 2, 1024), T("pscpu/pscpu", 2, -1))),
    ("nccl:2:1K, pscpu/pscpu:2", (T("nccl", 2, 1024), T("pscpu/pscpu", 2, -1))),
    ("nccl:1:1024,xring", (T("nccl", 1, 1024), T("xring", 1, -1))),
    ("xring:2:-1", (T("xring", 2, -1),)),
    ("xring:1:100,rechd:1:200,native:1:-1",
     (T("xring", 1, 100), T("rechd", 1, 200), T("native", 1, -1))),
]


@pytest.mark.parametrize("spec, entries", ACCEPTED, ids=[repr(a) for a, _ in ACCEPTED])
def test_accepted_forms(spec, entries):
    parsed = parse_spec(spec)
    assert isinstance(parsed, AllReduceSpec)
    assert parsed.entries == entries
    # entries are normalised: plain ints and the named tuple type
    for entry in parsed.entries:
        assert type(entry) is AllReduceSpecTuple
        assert type(entry.shards) is int and type(entry.limit) is int
    assert AllReduceSpec.parse(spec) == parsed


def test_parse_spec_returns_a_parsed_spec_unchanged():
    spec = parse_spec("xring")
    assert parse_spec(spec) is spec


def test_numpy_integers_are_accepted_and_normalised():
    np = pytest.importorskip("numpy")
    parsed = parse_spec([("nccl", np.int64(2), np.int32(1024)), ("xring", np.int8(1), -1)])
    assert parsed.entries == (T("nccl", 2, 1024), T("xring", 1, -1))
    assert all(type(e.shards) is int and type(e.limit) is int for e in parsed)


def test_sequence_protocol():
    spec = parse_spec("nccl#2:1K:pscpu/pscpu#2")
    assert len(spec) == 2
    assert spec[0] == T("nccl", 2, 1024)
    assert spec[-1].alg == "pscpu/pscpu"
    assert list(spec) == list(spec.entries)


# ------------------------------------------------------------------ errors

ALL_NAMES = algorithms.names()

REJECTED = [
    # wrong type of spec
    (None, SpecTypeError, r"must be a str, a tuple .* or a list .*got None \(NoneType\)"),
    ({}, SpecTypeError, r"must be a str, a tuple .* or a list .*got \{\} \(dict\)"),
    ({"alg": "xring"}, SpecTypeError, r"got \{'alg': 'xring'\} \(dict\)"),
    (3, SpecTypeError, r"must be a str, a tuple .*got 3 \(int\)"),
    (b"xring", SpecTypeError, r"got b'xring' \(bytes\)"),
    # empty
    ("", SpecError, r"empty all-reduce spec: expected at least one algorithm"),
    ("   ", SpecError, r"empty all-reduce spec: expected at least one algorithm"),
    ([], SpecError, r"empty all-reduce spec: expected at least one algorithm"),
    # tuple size
    ((), SpecError, r"spec \(\): a spec tuple has 1 to 3 elements .*got 0"),
    (("xring", 1, -1, 0), SpecError,
     r"spec \('xring', 1, -1, 0\): a spec tuple has 1 to 3 elements .*got 4"),
    ([("nccl", 1, 1024), ("xring", 1, -1, 9)], SpecError,
     r"entry 1 \('xring', 1, -1, 9\): a spec tuple has 1 to 3 elements .*got 4"),
    ((("nccl", 1, 1024), ("xring", 1, -1)), SpecTypeError,
     r"algorithm must be a str, got \('nccl', 1, 1024\).*pass a list of tuples"),
    # list element not a tuple
    (["xring"], SpecTypeError,
     r"entry 0 of the spec list is 'xring' \(a str\).*must be a tuple.*pass the string alone"),
    ([("nccl", 1, 1024), ["xring", 1, -1]], SpecTypeError,
     r"entry 1 of the spec list is \['xring', 1, -1\] \(a list\).*must be a tuple"),
    ([("xring", 1, -1), None], SpecTypeError,
     r"entry 1 of the spec list is None .*must be a tuple"),
    # unknown algorithm
    ("xrng", UnknownAlgorithmError, r"entry 0 'xrng': unknown all-reduce algorithm 'xrng'"),
    ("nccl:1K:ring", UnknownAlgorithmError, r"entry 1 'ring': unknown all-reduce algorithm 'ring'"),
    (("foo", 1), UnknownAlgorithmError, r"spec \('foo', 1\): unknown all-reduce algorithm 'foo'"),
    ([("nccl", 1, 10), ("bogus", 1, -1)], UnknownAlgorithmError,
     r"entry 1 \('bogus', 1, -1\): unknown all-reduce algorithm 'bogus'"),
    ("nccl:2:1024,hier:2:-1", UnknownAlgorithmError,
     r"entry 1 'hier:2:-1': unknown all-reduce algorithm 'hier'"),
    ((42,), SpecTypeError, r"spec \(42,\): the algorithm must be a str, got 42 \(int\)"),
    # shards
    ("nccl#0", SpecError, r"entry 0 'nccl#0': shards must be an integer >= 1, got 0"),
    ("xring#-3", SpecError, r"entry 0 'xring#-3': shards must be an integer >= 1, got -3"),
    ("xring#2.5", SpecTypeError, r"entry 0 'xring#2.5': shards must be an integer >= 1, got '2.5'"),
    ("xring#two", SpecTypeError, r"entry 0 'xring#two': shards must be an integer >= 1, got 'two'"),
    ("xring#:1K:rechd", SpecError,
     r"entry 0 'xring#': '#' must be followed by the number of shards"),
    ("xring:0", SpecError, r"'xring:0' is not well formed: expected alg\[#shards\]"),
    ("xring:2", SpecError, r"'xring:2' is not well formed: .*comma form alg:shards:limit"),
    (("xring", 0), SpecError, r"spec \('xring', 0\): shards must be an integer >= 1, got 0"),
    (("xring", 2.0), SpecTypeError,
     r"spec \('xring', 2\.0\): shards must be an integer >= 1, got 2\.0"),
    (("xring", True), SpecTypeError, r"shards must be an integer >= 1, got True"),
    (("xring", None), SpecTypeError, r"shards must be an integer >= 1, got None"),
    ([("nccl", 1, 1024), ("xring", -2, -1)], SpecError,
     r"entry 1 \('xring', -2, -1\): shards must be an integer >= 1, got -2"),
    # limit
    (("xring", 1, -2), SpecError,
     r"spec \('xring', 1, -2\): the limit must be an integer number of bytes >= 0, or -1 "
     r"for no limit, got -2"),
    (("xring", 1, 1024.0), SpecTypeError,
     r"the limit must be an integer number of bytes >= 0, or -1 .*got 1024\.0 \(float\)"),
    (("xring", 1, None), SpecTypeError, r"the limit must be an integer .*got None \(NoneType\)"),
    (("xring", 1, False), SpecTypeError, r"the limit must be an integer .*got False \(bool\)"),
    ([("nccl", 1, "1.5K"), ("xring", 1, -1)], SpecError,
     r"entry 0 \('nccl', 1, '1\.5K'\): limit: byte count '1\.5K' is not a whole number of bytes"),
    ("nccl:1.5K:xring", SpecError,
     r"entry 0 'nccl:1\.5K': limit: byte count '1\.5K' is not a whole number.*K/M/G/T"),
    ("nccl:abc:xring", SpecError, r"entry 0 'nccl:abc': limit: byte count 'abc'"),
    ("nccl:2:1K,xring:1:-5", SpecError,
     r"entry 1 'xring:1:-5': limit: byte count '-5' is not a whole number.*or -1 for no limit"),
    # limits not strictly increasing
    ([("nccl", 1, 1024), ("xring", 1, 1024), ("pscpu", 1, -1)], SpecError,
     r"limits must strictly increase: entry 1 \('xring', 1, 1024\) has limit 1024 B, not above "
     r"the 1024 B of entry 0 \('nccl', 1, 1024\)"),
    ("nccl:2K:xring:1K:pscpu", SpecError,
     r"limits must strictly increase: entry 1 'xring:1K' has limit 1024 B, not above the "
     r"2048 B of entry 0 'nccl:2K'"),
    ("xring:1:100,rechd:1:50,native", SpecError,
     r"limits must strictly increase: entry 1 'rechd:1:50' has limit 50 B.*entry 0 'xring:1:100'"),
    # -1 missing
    (("xring", 1, 1024), SpecError,
     r"no entry has limit -1 .*larger than 1 KiB.*make the last limit -1, e\.g\. "
     r"\('xring', 1, -1\)"),
    ([("nccl", 1, 1024), ("xring", 2, 4096)], SpecError,
     r"no entry has limit -1 .*larger than 4 KiB.*\('xring', 2, -1\)"),
    ("nccl:1:1024,xring:1:2048", SpecError, r"no entry has limit -1"),
    # -1 not last
    ([("xring", 1, -1), ("nccl", 1, 1024)], SpecError,
     r"entry 0 \('xring', 1, -1\) has limit -1 \(no upper bound\) but is not the last entry.*"
     r"move it to the end"),
    ("xring:1:-1,nccl:1:1024", SpecError,
     r"entry 0 'xring:1:-1' has limit -1 \(no upper bound\) but is not the last entry"),
    ("xring:-1:nccl", SpecError,
     r"entry 0 'xring:-1': limit -1 \(no limit\) can only end a spec.*leave the last limit out"),
    # -1 twice
    ([("xring", 1, -1), ("nccl", 1, -1)], SpecError,
     r"limit -1 appears more than once \(entries 0 \('xring', 1, -1\) and 1 \('nccl', 1, -1\)\)"),
    ("xring:1:-1,nccl:1:-1", SpecError,
     r"limit -1 appears more than once \(entries 0 'xring:1:-1' and 1 'nccl:1:-1'\)"),
    # malformed strings
    ("nccl#2:1K", SpecError,
     r"'nccl#2:1K' is not well formed: expected alg\[#shards\]\[:limit:alg\[#shards\]\]"),
    ("nccl:1K:", SpecError, r"entry 1 '': missing algorithm name in spec 'nccl:1K:'"),
    ("xring,", SpecError, r"entry 1 '': empty entry in the comma form 'xring,'"),
    ("xring#2:1K,rechd", SpecError,
     r"entry 0 'xring#2:1K': the comma form is alg:shards:limit.*'#shards' belongs to the other"),
    ("xring:1:1K:rechd,native", SpecError,
     r"entry 0 'xring:1:1K:rechd': a comma-form entry is alg\[:shards\[:limit\]\], got 4 fields"),
]


@pytest.mark.parametrize(
    "spec, exc_type, pattern", REJECTED, ids=[repr(r[0]) for r in REJECTED]
)
def test_rejected_specs_name_the_problem(spec, exc_type, pattern):
    with pytest.raises(exc_type, match=pattern) as info:
        parse_spec(spec)
    assert isinstance(info.value, SpecError)
    assert isinstance(info.value, ValueError)


def test_unknown_algorithm_lists_every_registered_name_and_suggests():
    with pytest.raises(UnknownAlgorithmError) as info:
        parse_spec("xrng")
    message = str(info.value)
    assert "did you mean 'xring'" in message
    listed = re.search(r"valid algorithms: ([^)]*)\)", message)
    assert listed, message
    assert listed.group(1).split(", ") == list(ALL_NAMES)


def test_unknown_algorithm_without_near_miss_gives_no_suggestion():
    with pytest.raises(UnknownAlgorithmError) as info:
        parse_spec("zzzzzzzz")
    assert "did you mean" not in str(info.value)
    assert all(name in str(info.value) for name in ALL_NAMES)


@pytest.mark.parametrize("typo, suggestion", [
    ("XRING", "xring"), ("ncl", "nccl"), ("pscpu/pcpu", "pscpu/pscpu"), ("rechd/nccl", None),
])
def test_did_you_mean(typo, suggestion):
    with pytest.raises(UnknownAlgorithmError, match=re.escape(repr(typo))) as info:
        parse_spec(typo)
    if suggestion is not None:
        assert f"did you mean '{suggestion}'" in str(info.value)


def test_errors_are_raised_eagerly_at_parse_time():
    # an unknown name in the last entry is caught even though routing never reaches it
    with pytest.raises(UnknownAlgorithmError, match="entry 2"):
        parse_spec("nccl:1K:xring:1M:nope")


# ------------------------------------------------------------------ bounds


DIGITS = "9" * 5000  # more than Python converts between int and str (4300 digits)


def test_shards_are_bounded():
    """Shards go up to MAX_SHARDS (1024), in every form; one more is a SpecError that
    names the value, the bound and the fix."""
    assert MAX_SHARDS == 1024
    for spec in ("xring#1024", ("xring", 1024), "xring:1024:-1", [("pscpu", "1024", -1)]):
        assert parse_spec(spec)[0].shards == 1024
    for spec in ("xring#1025", ("xring", 1025), "xring:1025:-1", "xring#100000000000",
                 [("rechd", 1, 1024), ("pscpu", 10**12, -1)]):
        with pytest.raises(SpecError, match=r"shards must be at most 1024, got 10\d+; .*"
                                            r"use e\.g\. 1, 2 or 4"):
            parse_spec(spec)


@pytest.mark.parametrize("spec, pattern", [
    (f"xring:{DIGITS}:pscpu", r"entry 0 'xring:9+'\.\.\.'9+' \(5006 characters\): limit: "
                              r"byte count '9+'\.\.\.'9+' \(5000 characters\) is too large: "
                              r"at most 9223372036854775807 bytes"),
    (f"xring:1:{DIGITS}0,rechd", r"byte count '9+'\.\.\.'9+0' \(5001 characters\) is too large"),
    (f"xring#{DIGITS}", r"shards must be an integer from 1 to 1024, got '9+'\.\.\.'9+' "
                        r"\(5000 characters\)"),
    (f"xring:-{DIGITS}:-1", r"shards must be an integer from 1 to 1024, got '-9+'"),
    (("xring", 10**5000), r"spec \('xring', <an integer of about 5001 digits>\): shards must "
                          r"be at most 1024"),
    (("xring", 1, 10**5000), r"the limit must be at most 9223372036854775807 bytes"),
    (("xring", 1, -(10**5000)), r"got -<an integer of about 5001 digits>"),
    ((10**5000,), r"the algorithm must be a str, got <an integer of about 5001 digits>"),
    ([("xring", 1, 1 << 63), ("rechd",)], r"at most 9223372036854775807 bytes .*, got "
                                          r"9223372036854775808"),
    ("xring:8388608T:rechd", r"byte count '8388608T' is too large"),
])
def test_huge_numbers_are_one_line_spec_errors(spec, pattern):
    """Numbers of thousands of digits (or just past 2**63 - 1 bytes) are a SpecError of
    one short line that names them, never Python's own ValueError from int() or repr()."""
    with pytest.raises(SpecError, match=pattern) as info:
        parse_spec(spec)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message


def test_limits_are_bounded_by_an_int64():
    assert MAX_BYTES == (1 << 63) - 1
    assert parse_spec("xring:8388607T:rechd")[0].limit == 8388607 * TB
    assert parse_bytes(MAX_BYTES) == MAX_BYTES
    assert parse_bytes("0" * 5000 + "1K") == K  # leading zeros are no digits
    for value in (MAX_BYTES + 1, 10**5000, "9223372036854775808", DIGITS, "8388608T"):
        with pytest.raises(SpecError, match="is too large: at most 9223372036854775807"):
            parse_bytes(value)
    with pytest.raises(SpecError, match=r"-<an integer of about 5001 digits> is not a whole"):
        parse_bytes(-(10**5000))


# ------------------------------------------------------------------ byte counts


@pytest.mark.parametrize("text, value", [
    ("0", 0), ("1", 1), ("1024", 1024), (" 77 ", 77),
    ("1K", K), ("1k", K), ("1KB", K), ("1kb", K), ("1KiB", K), ("1kib", K), ("1 K", K),
    ("32K", 32 * K), ("4M", 4 * M), ("4MiB", 4 * M), ("4mb", 4 * M),
    ("3G", 3 * G), ("2GiB", 2 * G), ("1T", TB), ("1tib", TB),
    ("5B", 5), ("-1", -1), (" -1 ", -1),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", [
    "", " ", "K", "KB", "-2", "-1K", "1.5K", "1,024", "+1024", "1P", "1E", "1 KK", "0x10",
    "ten", "1KBB",
])
def test_parse_bytes_rejects_bad_text(text):
    with pytest.raises(SpecError, match=re.escape(repr(text)) + r" is not a whole number of bytes"
                       r".*K/M/G/T suffix.*or -1"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["1iB", "1ib"])
def test_parse_bytes_rejects_binary_marker_without_unit(text):
    with pytest.raises(SpecError):
        parse_bytes(text)


@pytest.mark.parametrize("value", [None, 1.0, b"1K"])
def test_parse_bytes_rejects_non_strings(value):
    with pytest.raises(SpecTypeError, match=type(value).__name__):
        parse_bytes(value)


def test_parse_bytes_int_is_consistent_with_its_message():
    try:
        result = parse_bytes(1024)
    except SpecTypeError as exc:
        assert "or int" not in str(exc)
    else:
        assert result == 1024


@pytest.mark.parametrize("limit, text", [
    (-1, "-1"), (0, "0"), (1, "1"), (1000, "1000"), (1023, "1023"), (1024, "1K"),
    (1536, "1536"), (2048, "2K"), (M, "1M"), (1025 * K, "1025K"), (3 * G, "3G"),
    (TB, "1T"), (1024 * TB, "1024T"), (TB + K, str(TB // K + 1) + "K"),
])
def test_format_limit(limit, text):
    assert format_limit(limit) == text
    assert parse_bytes(text) == limit


@pytest.mark.parametrize("nbytes, text", [
    (None, "∞"), (-1, "∞"), (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1 KiB"),
    (1536, "1536 B"), (4 * M, "4 MiB"), (G, "1 GiB"), (2 * TB, "2 TiB"), (3 * K, "3 KiB"),
])
def test_format_bytes(nbytes, text):
    assert format_bytes(nbytes) == text


# ------------------------------------------------------------------ routing


def test_routing_at_the_boundaries():
    spec = parse_spec("nccl#2:1K:xring:1M:pscpu/pscpu#2")
    cases = [
        (0, 0), (1, 0), (1024, 0), (1025, 1), (M, 1), (M + 1, 2), (1 << 62, 2), (10 ** 30, 2),
    ]
    for nbytes, index in cases:
        assert spec.index_for(nbytes) == index, nbytes
        assert spec.route(nbytes) is spec.entries[index]


def test_routing_with_a_zero_limit():
    spec = parse_spec([("native", 1, 0), ("xring", 1, -1)])
    assert spec.route(0).alg == "native"
    assert spec.route(1).alg == "xring"


def test_single_entry_takes_everything():
    spec = parse_spec("rechd")
    assert {spec.index_for(n) for n in (0, 1, K, 1 << 50)} == {0}


def test_negative_size_is_rejected():
    spec = parse_spec("xring")
    with pytest.raises(ValueError, match="-5 bytes"):
        spec.index_for(-5)
    with pytest.raises(ValueError):
        spec.route(-1)


# ------------------------------------------------------------------ value semantics


def test_spec_is_immutable():
    spec = parse_spec("nccl#2:1K:xring")
    assert dataclasses.is_dataclass(spec)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.entries = ()
    with pytest.raises(TypeError):
        spec.entries[0] = T("xring")
    with pytest.raises(AttributeError):
        spec.entries[0].shards = 4
    assert spec.entries == (T("nccl", 2, 1024), T("xring", 1, -1))


def test_plan_rows_are_immutable():
    row = parse_spec("xring").plan()[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.alg = "nccl"


def test_equal_specs_from_different_forms_are_equal_and_hash_alike():
    forms = [
        "nccl#2:1K:pscpu/pscpu#2",
        "nccl:2:1024,pscpu/pscpu:2:-1",
        "nccl:2:1KiB,pscpu/pscpu:2",
        [("nccl", 2, 1024), ("pscpu/pscpu", 2, -1)],
        [T("nccl", 2, "1K"), T("pscpu/pscpu", 2)],
        AllReduceSpec((T("nccl", 2, 1024), T("pscpu/pscpu", 2, -1))),
    ]
    specs = [parse_spec(f) for f in forms]
    assert all(s == specs[0] for s in specs)
    assert len({hash(s) for s in specs}) == 1
    assert len({*specs}) == 1
    assert parse_spec("xring") == parse_spec(("xring",)) == parse_spec("xring:1:-1")


def test_different_specs_are_not_equal():
    assert parse_spec("xring") != parse_spec("xring#2")
    assert parse_spec("nccl:1K:xring") != parse_spec("nccl:2K:xring")
    assert parse_spec("nccl:1K:xring") != parse_spec("xring:1K:nccl")


def test_direct_construction_validates():
    assert AllReduceSpec((("xring", 2, -1),)) == parse_spec("xring#2")
    with pytest.raises(SpecError, match="empty"):
        AllReduceSpec(())
    with pytest.raises(SpecError, match="no entry has limit -1"):
        AllReduceSpec((("xring", 1, 1024),))
    with pytest.raises(UnknownAlgorithmError):
        AllReduceSpec((("nope", 1, -1),))
    with pytest.raises(SpecError, match="strictly increase"):
        AllReduceSpec((("nccl", 1, 10), ("xring", 1, 5), ("rechd", 1, -1)))


@pytest.mark.parametrize("entries", [
    (("xring", "2", -1),),
    (("nccl", 1, "1K"), ("xring", 2, "-1")),
])
def test_direct_construction_normalises_or_rejects_strings(entries):
    try:
        spec = AllReduceSpec(entries)
    except SpecError:
        return
    assert all(type(e.shards) is int and type(e.limit) is int for e in spec)
    assert spec == parse_spec([tuple(e) for e in entries])


def test_direct_construction_with_a_flat_tuple_raises_a_spec_error():
    with pytest.raises(SpecError):
        AllReduceSpec(("xring", 1, -1))


def test_repr_shows_the_spec():
    assert repr(parse_spec("nccl#2:1K:xring")) == "AllReduceSpec('nccl#2:1K:xring')"


# ------------------------------------------------------------------ plan


def test_plan_rows():
    rows = parse_spec("nccl#2:1K:pscpu/pscpu#2").plan()
    assert [type(r) for r in rows] == [PlanRow, PlanRow]
    first, second = rows
    assert (first.index, first.alg, first.shards, first.limit) == (0, "nccl", 2, 1024)
    assert (first.min_bytes, first.max_bytes) == (0, 1024)
    assert first.range_text == "0 B – 1 KiB"
    assert first.hierarchical is False and first.intra is None and first.inter is None
    assert first.needs_gpu is True
    assert first.shards_meaning == "ignored"
    assert (second.index, second.alg, second.shards, second.limit) == (1, "pscpu/pscpu", 2, -1)
    assert (second.min_bytes, second.max_bytes) == (1025, None)
    assert second.range_text == "1 KiB – ∞"
    assert second.hierarchical is True
    assert (second.intra, second.inter) == ("pscpu", "pscpu")
    assert second.needs_gpu is False


def test_plan_rows_tile_the_byte_range():
    spec = parse_spec([("native", 1, 0), ("xring", 1, 1536), ("rechd", 1, M),
                       ("nccl/xring", 4, -1)])
    rows = spec.plan()
    assert [r.range_text for r in rows] == [
        "0 B – 0 B", "0 B – 1536 B", "1536 B – 1 MiB", "1 MiB – ∞",
    ]
    assert [(r.min_bytes, r.max_bytes) for r in rows] == [
        (0, 0), (1, 1536), (1537, M), (M + 1, None),
    ]
    for row in rows:
        assert spec.index_for(row.min_bytes) == row.index
        if row.max_bytes is not None:
            assert spec.index_for(row.max_bytes) == row.index
    assert [r.hierarchical for r in rows] == [False, False, False, True]


def test_plan_row_as_dict():
    row = parse_spec("nccl/xring#2").plan()[0]
    data = row.as_dict()
    assert data["algorithm"] == "nccl/xring"
    assert data["range"] == "0 B – ∞"
    assert data["max_bytes"] is None
    assert data["hierarchical"] is True
    assert data["intra"] == "nccl" and data["inter"] == "xring"
    assert data["shards_meaning"] == "ring pipelines in flight"


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("spec, text, comma", [
    ("xring", "xring", "xring:1:-1"),
    ("pscpu#4", "pscpu#4", "pscpu:4:-1"),
    ("nccl:2:1024,pscpu/pscpu:2:-1", "nccl#2:1K:pscpu/pscpu#2", "nccl:2:1024,pscpu/pscpu:2:-1"),
    ([("native", 1, 0), ("xring", 3, 1000), ("rechd", 1, -1)],
     "native:0:xring#3:1000:rechd", "native:1:0,xring:3:1000,rechd:1:-1"),
    ("nccl:4M:nccl/rechd", "nccl:4M:nccl/rechd", f"nccl:1:{4 * M},nccl/rechd:1:-1"),
])
def test_string_forms(spec, text, comma):
    parsed = parse_spec(spec)
    assert str(parsed) == text
    assert parsed.to_comma_form() == comma
    assert parse_spec(text) == parsed
    assert parse_spec(comma) == parsed


@st.composite
def valid_entries(draw):
    names = algorithms.names()
    count = draw(st.integers(min_value=1, max_value=5))
    sizes = draw(st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=1 << 45),
            st.builds(lambda n, s: n << s, st.integers(1, 4096), st.sampled_from([10, 20, 30, 40])),
        ),
        min_size=count - 1, max_size=count - 1, unique=True,
    ))
    limits = sorted(sizes) + [-1]
    return tuple(
        T(draw(st.sampled_from(names)), draw(st.integers(min_value=1, max_value=8)), limit)
        for limit in limits
    )


@settings(max_examples=200, deadline=None)
@given(valid_entries())
def test_property_round_trips(entries):
    spec = parse_spec(list(entries))
    assert spec.entries == entries
    assert parse_spec(str(spec)) == spec
    assert parse_spec(spec.to_comma_form()) == spec
    assert parse_spec([tuple(e) for e in spec]) == spec
    assert hash(parse_spec(str(spec))) == hash(spec)


@settings(max_examples=200, deadline=None)
@given(valid_entries(), st.data())
def test_property_routing_picks_first_entry_with_limit_at_least_size(entries, data):
    spec = parse_spec(list(entries))
    bounded = [e.limit for e in entries if e.limit != -1]
    interesting = [0, 1 << 50] + [x + d for x in bounded for d in (-1, 0, 1) if x + d >= 0]
    nbytes = data.draw(st.one_of(
        st.sampled_from(interesting), st.integers(min_value=0, max_value=1 << 50)
    ))
    expected = next(i for i, e in enumerate(entries) if e.limit == -1 or e.limit >= nbytes)
    assert spec.index_for(nbytes) == expected
    assert spec.route(nbytes) == entries[expected]
    row = spec.plan()[expected]
    assert row.min_bytes <= nbytes
    assert row.max_bytes is None or nbytes <= row.max_bytes


# ------------------------------------------------------------------ messages we want clearer


@pytest.mark.parametrize("spec", ["xring#2:-1", "nccl#2:1K:pscpu/pscpu#2:-1"])
def test_trailing_unbounded_limit_in_tf_grammar_is_explained(spec):
    with pytest.raises(SpecError, match=r"-1.*leave (the last limit|it) out"):
        parse_spec(spec)
