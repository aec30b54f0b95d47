"""Statistics, the table, the recommendation and the cost model of ``mpistrat bench``
on synthetic points (pure: no MPI)."""

from __future__ import annotations

import math

import pytest

from mpistrat import parse_spec
from mpistrat.bench import costmodel
from mpistrat.bench.recommend import recommend
from mpistrat.bench.report import Table, summary_lines
from mpistrat.bench.results import Point, bus_factor
from mpistrat.bench.runner import best_lines
from mpistrat.cli.validate import render_plan

KiB, MiB = 1 << 10, 1 << 20


def point(label, nbytes, seconds, *, wrong=0, kind="algorithm", participants=2,
          samples=None):
    alg, _, shards = label.partition("#")
    return Point(nbytes=nbytes, count=nbytes // 4, dtype="float32", op="sum", label=label,
                 kind=kind, alg=alg if kind == "algorithm" else None,
                 shards=int(shards or 1), participants=participants,
                 samples=tuple(samples or (seconds, seconds * 0.9, seconds * 1.5)),
                 wrong=wrong, checked=1, wrong_iterations=int(wrong > 0))


def sweep(times: dict[str, list[float]], sizes: list[int], **kwargs) -> list[Point]:
    return [point(label, n, t, **kwargs) for i, n in enumerate(sizes)
            for label, ts in times.items() for t in [ts[i]]]


# ------------------------------------------------------------------ statistics


def test_bus_factor_is_nccl_tests_allreduce_factor():
    assert bus_factor(1) == 0
    assert bus_factor(2) == 1
    assert bus_factor(8) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        bus_factor(0)


def test_point_statistics():
    p = point("xring", 1 << 20, 0.002, participants=4, samples=(0.003, 0.001, 0.002, 0.004))
    assert p.median == pytest.approx(0.0025)
    assert (p.min, p.max) == (0.001, 0.004)
    assert p.algbw == pytest.approx((1 << 20) / 0.0025 / 1e9)
    assert p.busbw == pytest.approx(p.algbw * 1.5)
    native = point("native", 1 << 20, 0.005, samples=(0.005,))
    assert p.speedup_over(native) == pytest.approx(2.0)
    assert p.speedup_over(None) is None
    with pytest.raises(ValueError, match="no samples"):
        Point(4, 1, "float32", "sum", "x", "algorithm", "x", 1, 2, samples=())


def test_point_dict_round_trip():
    p = point("pscpu#2", 4096, 1e-4)
    record = p.as_dict(point("native", 4096, 2e-4))
    assert record["speedup_over_native"] == pytest.approx(2.0)
    assert record["iters"] == 3 and record["samples"] == list(p.samples)
    assert Point.from_dict(record) == p


def test_table_rows_and_footer():
    points = sweep({"native": [1e-5], "rechd": [5e-6]}, [1024])
    table = Table(p.label for p in points)
    header, units = table.header().splitlines()
    assert header.startswith("#") and "busbw" in header and "#wrong" in header
    assert "(us)" in units and "(GB/s)" in units
    rows = table.rows(points).splitlines()
    assert rows[0].split()[:5] == ["1024", "256", "float32", "sum", "native"]
    assert rows[1].split()[-1] == "2.00x" and rows[0].split()[-1] == "1.00x"
    assert "| 1 KiB |" in table.markdown(points)
    footer = summary_lines(points)
    assert footer[0] == "# #wrong total : 0 OK"
    assert "rechd" in footer[1]
    wrong = summary_lines([point("x", 8, 1e-5, wrong=3)])
    assert "WRONG RESULTS" in wrong[0]
    assert best_lines(points) == ["# Best vs native: 1 KiB rechd 2.00x"]


# ------------------------------------------------------------------ recommendation


SIZES = [4, 64, KiB, 16 * KiB, 256 * KiB, 4 * MiB, 64 * MiB]


def test_recommendation_merges_ranges_and_routes_as_printed():
    times = {
        "native": [10e-6, 11e-6, 12e-6, 40e-6, 300e-6, 3e-3, 60e-3],
        "rechd": [8e-6, 8e-6, 9e-6, 41e-6, 280e-6, 2.9e-3, 20e-3],
        "xring#2": [25e-6, 25e-6, 25e-6, 45e-6, 250e-6, 2.0e-3, 15e-3],
    }
    points = sweep(times, SIZES)
    rec = recommend(points, tolerance=0.03)
    # 16 KiB: rechd is within 3 % of native and was chosen at 1 KiB -> kept
    assert [c.label for c in rec.choices] == ["rechd", "xring#2"]
    assert str(rec.spec) == "rechd:64K:xring#2"
    spec = parse_spec(str(rec.spec))
    for choice in rec.choices:
        for size in choice.sizes:
            entry = spec.route(size)
            assert (entry.alg, entry.shards) == (choice.alg, choice.shards)
    render_plan(spec)  # what mpistrat validate prints
    assert rec.choices[1].gains[-1] == pytest.approx(4.0)
    lines = rec.lines()
    assert lines[-1] == "spec: rechd:64K:xring#2"
    assert any("64 KiB – ∞" in line and "xring#2" in line for line in lines)
    assert rec.as_dict()["ranges"][0]["sizes"] == [4, 64, KiB, 16 * KiB]


def test_zero_tolerance_picks_the_raw_fastest():
    times = {"native": [10e-6, 10e-6, 10e-6], "rechd": [9.9e-6, 10.1e-6, 9.9e-6]}
    rec = recommend(sweep(times, [4, 64, KiB]), tolerance=0)
    assert str(rec.spec) == "rechd:16:native:256:rechd"
    # within 5 % everything ties, and a tie with no previous choice goes to native
    assert str(recommend(sweep(times, [4, 64, KiB]), tolerance=0.05).spec) == "native"


def test_wrong_results_specs_and_peers_are_never_recommended():
    points = [point("native", 4, 10e-6), point("corrupt", 4, 1e-6, wrong=1),
              point("spec:rechd", 4, 1e-6, kind="spec"),
              point("torch-gloo", 4, 1e-6, kind="torch")]
    assert str(recommend(points).spec) == "native"
    with pytest.raises(ValueError, match="nothing to recommend"):
        recommend([point("corrupt", 4, 1e-6, wrong=1)])
    with pytest.raises(ValueError, match="tolerance"):
        recommend(points, tolerance=-1)


def test_boundary_is_a_power_of_two_between_the_sizes():
    times = {"native": [1, 1, 9, 9], "rechd": [9, 9, 1, 1]}
    rec = recommend(sweep(times, [100, 1000, 3000, 10000]), tolerance=0)
    assert rec.spec[0].limit == 1024 and rec.spec[0].alg == "native"
    rec = recommend(sweep({"native": [1, 9], "rechd": [9, 1]}, [1000, 1001]), tolerance=0)
    assert rec.spec[0].limit == 1000


# ------------------------------------------------------------------ cost model


def test_terms_follow_the_classic_formulas():
    # on one host every step stays inside it: the classic single-level counts
    def one_host(alg, shards, ranks):
        t = costmodel.terms(alg, shards, costmodel.Layout.from_counts([ranks]), 1 << 20)
        assert (t.l_net, t.b_net) == (0, 0)
        return t.l_in, t.b_in

    assert one_host("native", 1, 8) == (6, 1.75)
    assert one_host("xring", 2, 4) == (12, 1.5)
    assert one_host("rechd", 1, 8) == (6, 1.75)
    assert one_host("rechd", 1, 6) == (6, 1.5 + 2)  # 4 folded + 2 extra steps
    # the gather rank takes p-1 contributions and sends p-1 results, overlapped
    assert one_host("pscpu", 1, 4) == (3, 3)
    assert one_host("pscpu", 4, 4) == (6, 1.5)
    assert one_host("xring", 1, 1) == (0, 0)
    # 8 ranks on 2 hosts: pscpu reduce onto the leader of 4 (2(k-1) messages, 2(k-1)/k
    # at the root), pscpu#2 over the 2 leaders (one rank per link), MPICH's broadcast
    t = costmodel.terms("pscpu/pscpu", 2, 8, 1 << 20, nodes=2)
    assert (t.l_in, t.b_in) == pytest.approx((6 + 2 + 3, 1.5 + 1.5))
    assert (t.l_net, t.b_net, t.share) == (2, 1, 1)
    with pytest.raises(KeyError):
        costmodel.terms("nosuch", 1, 2)


def test_fit_recovers_alpha_and_beta():
    assert costmodel.fit_points([1, 2, 3], [3, 5, 7]) == pytest.approx((1, 2))
    alpha, beta = 5e-6, 2e-10
    sizes = [4 << (2 * i) for i in range(12)]
    points = []
    for name, shards in (("xring", 1), ("rechd", 1), ("pscpu", 4)):
        label = name if shards == 1 else f"{name}#{shards}"
        for n in sizes:
            t = costmodel.terms(name, shards, 4, n)
            seconds = alpha * t.l_in + beta * t.b_in * n
            points.append(point(label, n, seconds, participants=4, samples=(seconds,)))
    model = costmodel.fit(points, ranks=4, nodes=1)
    assert [f.label for f in model.fits] == ["xring", "rechd", "pscpu#4"]
    for f in model.fits:
        # one host: the link level is not measured and shares the host's numbers
        assert f.alpha_in == pytest.approx(alpha) and f.beta_in == pytest.approx(beta)
        assert (f.alpha_net, f.beta_net) == (f.alpha_in, f.beta_in)
        assert set(f.shared) == {"alpha", "beta"}
        assert f.max_error < 1e-9
    assert "a_in(us)" in "\n".join(model.lines())
    prediction = costmodel.predict(model, 1024, 8, [4, 1 << 20])
    assert prediction.nodes == 128
    ring = prediction.times["xring"]
    assert ring[0] == pytest.approx(alpha * 2 * 1023)
    assert prediction.best()[0] == "rechd"  # fewest steps at 4 B
    assert "1024 ranks, 8 per host (128 hosts x 8)" in prediction.lines()[0]


def test_fit_edges_and_skips():
    a, b = costmodel.fit_points([1, 10, 100], [5, 5, 5])  # flat: all latency
    assert b == 0 and a == pytest.approx(5)
    model = costmodel.fit([point("mystery", 4, 1e-5), point("native", 4, 1e-5,
                                                             participants=1)], 1, 1)
    assert not model.fits and len(model.skipped) == 2
    with pytest.raises(ValueError, match="no fitted algorithm"):
        costmodel.predict(model, 8, 4, [4])
    assert math.isfinite(costmodel.fit([point("native", 4, 1e-5)], 2, 1).fits[0].alpha_in)
