"""The two-level cost model (inside hosts / across links): term counts worked out by
hand for known layouts, recovery of known parameters from synthetic sweeps, prediction
output, saved models, and the hosts/link metadata (pure: no MPI)."""

from __future__ import annotations

import importlib
import json
import random

import pytest

from mpistrat.algorithms.shuffle import PIECE_BYTES  # (one message per piece)
from mpistrat.bench import costmodel
from mpistrat.bench.costmodel import Layout, Sweep, Terms, terms
from mpistrat.bench.files import write_json
from mpistrat.bench.metadata import hosts_layout, network, parse_rate
from mpistrat.bench.report import describe_run
from mpistrat.bench.results import Point

KiB, MiB = 1 << 10, 1 << 20
ONE_HOST = Layout.from_counts([4])
TWO_HOSTS = Layout.from_counts([2, 2])


def approx_terms(l_in=0.0, b_in=0.0, l_net=0.0, b_net=0.0):
    return pytest.approx((l_in, b_in, l_net, b_net))


def as_tuple(t: Terms):
    return (t.l_in, t.b_in, t.l_net, t.b_net)


def point(label, nbytes, seconds):
    alg, _, shards = label.partition("#")
    return Point(nbytes=nbytes, count=nbytes // 4, dtype="float32", op="sum", label=label,
                 kind="algorithm", alg=alg, shards=int(shards or 1), participants=4,
                 samples=(seconds,), checked=1)


# ------------------------------------------------------------------ layouts


def test_layouts():
    assert Layout.per_host(1024, 8).describe() == "128 hosts x 8"
    assert Layout.per_host(10, 4).ranks_per_host == [4, 4, 2]
    assert Layout.from_counts([3, 1]).describe() == "2 hosts of 3+1"
    assert ONE_HOST.describe() == "1 host x 4" and ONE_HOST.hosts == 1
    assert Layout.even(4, 2) == TWO_HOSTS
    meta = {"ranks": 4, "nodes": 2, "hostnames_by_rank": ["a", "a", "b", "b"]}
    assert costmodel.layout_from_meta(meta) == TWO_HOSTS
    # virtual nodes of 2 on one host: one link, two node groups
    meta = {"ranks": 4, "nodes": 2, "hostnames_by_rank": ["vm"] * 4,
            "virtual_ranks_per_node": 2}
    virtual = costmodel.layout_from_meta(meta)
    assert virtual.hosts == 1 and virtual.node_groups == [[0, 1], [2, 3]]
    assert costmodel.layout_from_meta({"ranks": 6, "nodes": 3}) == Layout.from_counts([2] * 3)
    assert Layout.from_dict(virtual.as_dict()) == virtual


# ------------------------------------------------------------------ terms by hand


def test_ring_crosses_each_link_once_per_direction():
    # one host: the classic 2(p-1) steps of n/p
    assert as_tuple(terms("xring", 1, ONE_HOST, MiB)) == approx_terms(6, 1.5)
    # two hosts: every step has a message on each link direction, one rank's
    t = terms("xring", 1, TWO_HOSTS, MiB)
    assert as_tuple(t) == approx_terms(l_net=6, b_net=1.5) and t.share == 1
    assert terms("xring", 2, TWO_HOSTS, MiB).l_net == 12  # two pipelines: twice the messages
    # 128 hosts x 8: still one rank per link direction, 2(p-1)/p of the buffer
    t = terms("xring", 1, Layout.per_host(1024, 8), MiB)
    assert as_tuple(t) == approx_terms(l_net=2046, b_net=2 * 1023 / 1024) and t.share == 1
    # ranks interleaved over hosts: the algorithms sort them by host first
    assert terms("xring", 1, Layout((0, 1, 0, 1)), MiB) == terms("xring", 1, TWO_HOSTS, MiB)


def test_halving_doubling_levels_depend_on_rank_order():
    # host-major, 2 x 2: the mask-1 step stays inside hosts (n/2 each way), the mask-2
    # step crosses with both ranks of a host at once (2 x n/4 on each link direction)
    t = terms("rechd", 1, TWO_HOSTS, MiB)
    assert as_tuple(t) == approx_terms(2, 1.0, 2, 1.0) and t.share == 2
    # interleaved order (rechd sorts by host): the same counts
    assert terms("rechd", 1, Layout((0, 1, 0, 1)), MiB) == t
    # 4 hosts x 4: lg k steps inside, lg H across carrying 2(H-1)/H on each link
    t = terms("rechd", 1, Layout.per_host(16, 4), MiB)
    assert as_tuple(t) == approx_terms(4, 1.5, 4, 1.5) and t.share == 4
    t = terms("rechd", 1, Layout.per_host(1024, 8), MiB)
    assert as_tuple(t) == approx_terms(6, 1.75, 14, 2 * 127 / 128) and t.share == 8
    # uneven 3 + 1: rank 3 is alone on its host, so every step crosses
    assert as_tuple(terms("rechd", 1, Layout.from_counts([3, 1]), MiB)) == \
        approx_terms(l_net=4, b_net=1.5)
    # short buffers: recursive doubling, lg p steps of the whole buffer
    assert as_tuple(terms("rechd", 1, TWO_HOSTS, 1 * KiB)) == approx_terms(1, 1.0, 1, 2.0)
    # 6 ranks on one host: fold in, 2 lg 4 steps among 4, fold out
    assert as_tuple(terms("rechd", 1, Layout.from_counts([6]), MiB)) == \
        approx_terms(6, 1.5 + 2)


def test_native_is_mpich_node_aware_composition():
    # 2 x 2: reduce and broadcast inside each host (rechd's counts on 2 ranks), between
    # them the two leaders' reduce-scatter + allgather: n/2 each way twice, one rank per
    # link, whatever the launcher's rank order
    t = terms("native", 1, TWO_HOSTS, MiB)
    assert as_tuple(t) == approx_terms(2, 1.0, 2, 1.0) and t.share == 1
    assert terms("native", 1, Layout((0, 1, 0, 1)), MiB) == t
    # 1 KiB: recursive doubling inside hosts (rechd's short buffers), still
    # reduce-scatter + allgather among the leaders (more elements than leaders)
    assert as_tuple(terms("native", 1, TWO_HOSTS, KiB)) == approx_terms(1, 1.0, 2, 1.0)
    # one element among two leaders: recursive doubling, one step of the whole buffer
    assert as_tuple(terms("native", 1, Layout.from_counts([1, 1]), 4)) == \
        approx_terms(l_net=1, b_net=1.0)
    # uneven 3 + 1: the host of 3 ranks sets the steps inside hosts
    assert as_tuple(terms("native", 1, Layout.from_counts([3, 1]), MiB)) == \
        approx_terms(4, 1.0 + 2, 2, 1.0)
    # one host: rechd's counts
    assert terms("native", 1, ONE_HOST, MiB) == terms("rechd", 1, ONE_HOST, MiB)


def test_shuffle_link_load():
    # pscpu#1 on 2 x 2: the gather rank's host link carries both remote contributions in
    # and both results out; a piece of one message goes back only once it has arrived
    # whole, so the two directions take turns (2 + 2)
    t = terms("pscpu", 1, TWO_HOSTS, PIECE_BYTES)
    assert as_tuple(t) == approx_terms(l_net=2, b_net=4.0) and t.share == 2
    # in 4 messages the scatter of one overlaps the gather of the next: 4/4 + 3/4 x 2
    assert terms("pscpu", 1, TWO_HOSTS, 4 * PIECE_BYTES).b_net == pytest.approx(2.5)
    # as a stage of a pipeline (pscpu/pscpu's leaders, pieces in flight): 2 at once
    lone = costmodel._flat("pscpu", [0, 0, 1, 1], 1, PIECE_BYTES, alone=False)
    assert lone.b_net == pytest.approx(2.0)
    # pscpu#2: a gather rank on each host, n/2 + n/2 each way
    assert as_tuple(terms("pscpu", 2, TWO_HOSTS, MiB)) == approx_terms(l_net=3, b_net=2.0)
    # 3 + 1: the lone rank's link carries its piece's 3 contributions and 3 results
    assert as_tuple(terms("pscpu", 4, Layout.from_counts([3, 1]), MiB)) == \
        approx_terms(l_net=6, b_net=1.5)
    # one host: the gather rank takes p-1 contributions and sends p-1 results
    assert as_tuple(terms("pscpu", 1, ONE_HOST, MiB)) == approx_terms(3, 3.0)
    assert as_tuple(terms("pscpu", 4, ONE_HOST, MiB)) == approx_terms(6, 1.5)
    # the per-host count (large jobs) agrees with the message-by-message one
    rng = random.Random(7)
    for _ in range(40):
        counts = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        hosts = [h for h, c in enumerate(counts) for _ in range(c)]
        owners = rng.sample(range(len(hosts)), rng.randint(1, len(hosts)))
        messages = rng.choice([0, 1, 3])
        assert as_tuple(costmodel._shuffle_counted(hosts, owners, messages)) == \
            pytest.approx(as_tuple(costmodel._shuffle_group(hosts, owners, None, messages)))


def test_hierarchical_sends_only_from_leaders():
    # 4 MiB (one piece): shm reduce + rechd over 2 leaders (one rank per link) + shm bcast
    t = terms("shm/rechd", 1, TWO_HOSTS, 4 * MiB)
    assert as_tuple(t) == approx_terms(2 + 2, 1.0 + 1.0, 2, 1.0) and t.share == 1
    t = terms("shm/rechd", 1, Layout.per_host(1024, 8), 4 * MiB)
    assert as_tuple(t) == approx_terms(4, 1.75 + 1.0, 14, 2 * 127 / 128) and t.share == 1
    # pscpu/pscpu#2: pscpu reduce to the leader (2(k-1) messages, 2(k-1)/k at the
    # root), pscpu#2 over 2 leaders, MPICH's broadcast (scatter + allgather at 4 MiB)
    assert as_tuple(terms("pscpu/pscpu", 2, TWO_HOSTS, 4 * MiB)) == \
        approx_terms(2 + 2, 1.0 + 1.0, 2, 1.0)
    # one node: a's all-reduce over the node, every rank gathering for shuffles
    assert terms("pscpu/pscpu", 1, ONE_HOST, MiB) == terms("pscpu", 4, ONE_HOST, MiB)
    # virtual nodes on one host: the cross-node stage stays inside the host
    virtual = Layout((0,) * 4, (0, 0, 1, 1))
    assert terms("shm/rechd", 1, virtual, 4 * MiB).l_net == 0


def test_pipelined_hierarchical_counts_the_slowest_stage_per_piece():
    piece = getattr(importlib.import_module("mpistrat.algorithms.hierarchical"),
                    "PIPELINE_BYTES", None)
    if piece is None:
        pytest.skip("a/b does not pipeline in this checkout")
    n = 8 * piece  # 8 pieces
    assert costmodel.pipeline_pieces("shm/rechd", TWO_HOSTS, n) == 8
    assert costmodel.pipeline_pieces("shm/rechd", TWO_HOSTS, piece) == 1
    assert costmodel.pipeline_pieces("shm/rechd", Layout.from_counts([1, 1]), n) == 1
    # stages on one piece: (2, 1/8) inside, (2, 1/8) across, (2, 1/8) inside; the
    # cross-host one is slowest and counts 7 more times
    t = terms("shm/rechd", 1, TWO_HOSTS, n)
    assert as_tuple(t) == approx_terms(4, 2 / 8, 2 * 8, 1.0)
    # parameters that make the node stages slowest move the repeats there
    slow_node = (1e-3, 1e-6, 1e-9, 1e-12)
    t = terms("shm/rechd", 1, TWO_HOSTS, n, params=slow_node)
    assert t.l_in == pytest.approx(4 + 7 * 2) and t.l_net == pytest.approx(2)


def test_unmodelled():
    with pytest.raises(KeyError):
        terms("nosuch", 1, TWO_HOSTS)
    with pytest.raises(KeyError):
        terms("shm", 1, TWO_HOSTS)  # one node only


# ------------------------------------------------------------------ fitting


TRUE = (8e-6, 0.25e-9, 90e-6, 8e-9)  # alpha_in, beta_in, alpha_net, beta_net
SIZES = [256 << (2 * i) for i in range(10)]  # 256 B .. 64 MiB
LABELS = ["xring", "xring#2", "rechd", "native", "pscpu#2", "pscpu/pscpu", "shm/rechd"]


def synthetic(layout: Layout, params=TRUE, labels=LABELS) -> list[Point]:
    out = []
    for label in labels:
        alg, _, shards = label.partition("#")
        for n in SIZES:
            t = terms(alg, int(shards or 1), layout, n, params=params)
            out.append(point(label, n, t.time(params, n)))
    return out


def test_two_layouts_recover_both_levels():
    one, two = synthetic(ONE_HOST), synthetic(TWO_HOSTS)
    model = costmodel.fit_sweeps([Sweep(tuple(two), TWO_HOSTS), Sweep(tuple(one), ONE_HOST)])
    assert [f.label for f in model.fits] == LABELS
    for f in model.fits:
        assert not f.shared, f.label
        assert f.params == pytest.approx(TRUE, rel=1e-6), f.label
        assert f.max_error < 1e-9
    lines = "\n".join(model.lines())
    assert "a_net(us)" in lines and "err 2 hosts x 2" in lines and "err 1 host x 4" in lines
    errors = model.error_lines()
    assert errors[0] == "# Model error per size on 2 hosts x 2 (model / measured - 1)"
    assert "+0%" in errors[-1]
    # a wrong level term would not recover: doubling rechd's link bytes in the data
    # (as if the ranks of a host did not share the link) moves beta_net
    wrong = [point("rechd", n, TRUE[1] * 1.0 * n + TRUE[0] * 2 + TRUE[2] * 2
                   + TRUE[3] * 2.0 * n) for n in SIZES if n > 2 * KiB]
    model = costmodel.fit_sweeps([Sweep(tuple(wrong), TWO_HOSTS),
                                  Sweep(tuple(p for p in one if p.label == "rechd"), ONE_HOST)])
    assert model.fits[0].beta_net == pytest.approx(2 * TRUE[3], rel=1e-3)


def test_a_link_burst_is_found_and_kept():
    # a shaped link passes each call's first 256 KiB at 2 ns/B, the rest at 8 ns/B
    burst, beta_burst = 256 * KiB, 2e-9
    labels = ["xring", "rechd", "pscpu/pscpu", "shm/rechd"]  # (a pipelined one too)
    truth = {label: costmodel.Fit(label, *_alg_shards(label), *TRUE, beta_burst=beta_burst,
                                  burst=burst) for label in labels}

    def sweep(layout):
        return Sweep(tuple(point(label, n, truth[label].time(n, layout))
                           for label in labels for n in SIZES), layout)

    sweeps = [sweep(TWO_HOSTS), sweep(ONE_HOST)]
    model = costmodel.fit_sweeps(sweeps)
    assert model.burst == burst
    for f in model.fits:
        assert f.params == pytest.approx(TRUE, rel=1e-6), f.label
        assert f.beta_burst == pytest.approx(beta_burst, rel=1e-6), f.label
        assert f.max_error < 1e-6, f.label
    # without a burst the same points miss by far more (the 64 KiB..1 MiB calls)
    plain = costmodel.fit_sweeps(sweeps, bursts=(0,))
    assert plain.burst == 0 and max(f.max_error for f in plain.fits) > 0.2
    text = "\n".join(model.lines())
    assert "b_burst*min(x, 256 KiB) + b_net*max(0, x - 256 KiB)" in text
    assert "b_burst(ns/B)" in text
    rechd = next(f for f in model.fits if f.label == "rechd")
    assert "min(x, 256 KiB) x 2 ns/B + max(0, x - 256 KiB) x 8 ns/B with x = 1 n" in \
        rechd.formula(TWO_HOSTS, MiB)
    # the burst is kept in the saved model and in predictions
    loaded = costmodel.CostModel.from_dict(model.as_dict(), "fit.json")
    assert loaded.burst == burst and loaded.fits[0].beta_burst == model.fits[0].beta_burst
    prediction = costmodel.predict(loaded, 1024, 8, [4, MiB])
    assert "(burst 256 KiB per call)" in prediction.lines()[0]
    net = rechd.terms(MiB, Layout.per_host(1024, 8)).b_net * MiB
    assert prediction.parts["rechd"][1][3] == pytest.approx(
        beta_burst * burst + TRUE[3] * (net - burst))
    # an exact plain fit stays without one
    exact = costmodel.fit_sweeps([Sweep(tuple(synthetic(TWO_HOSTS, labels=labels)), TWO_HOSTS),
                                  Sweep(tuple(synthetic(ONE_HOST, labels=labels)), ONE_HOST)])
    assert exact.burst == 0 and "b_burst" not in "\n".join(exact.lines())


def test_phases_that_take_turns_on_a_link_pass_a_burst_each():
    # pscpu#1 on 2 x 2 in one message: the gather comes in on the gather rank's link
    # (2 x 64 KiB), then the scatter goes out on it: each direction passes its own burst
    t = terms("pscpu", 1, TWO_HOSTS, 64 * KiB)
    assert t.b_net == pytest.approx(4) and t.directions == 2
    fit = costmodel.Fit("pscpu", "pscpu", 1, *TRUE, beta_burst=2e-9, burst=128 * KiB)
    assert fit.parts(64 * KiB, TWO_HOSTS)[3] == pytest.approx(2e-9 * 256 * KiB)
    # rechd uses both directions at once: one burst
    t = terms("rechd", 1, TWO_HOSTS, 256 * KiB)
    assert t.directions == 1
    fit = costmodel.Fit("rechd", "rechd", 1, *TRUE, beta_burst=2e-9, burst=128 * KiB)
    assert fit.parts(256 * KiB, TWO_HOSTS)[3] == pytest.approx(
        2e-9 * 128 * KiB + TRUE[3] * (t.b_net * 256 * KiB - 128 * KiB))
    # a shuffle whose link is busiest with both phases at once (one gather rank per
    # host) gets one burst too
    t = terms("pscpu", 2, TWO_HOSTS, 64 * KiB)
    assert t.directions == 1


def test_inline_messages_are_counted_apart():
    # 2 x 2 host-major: xring#2 at 256 B sends 32 B chunks, at 1 KiB 128 B, at 4 KiB 512 B
    for n, inline in ((256, True), (KiB, True), (4 * KiB, False)):
        t = terms("xring", 2, TWO_HOSTS, n, inline=128)
        assert t.l_net == 12 and t.l_inline == (12 if inline else 0), n
    # rechd at 256 B: recursive doubling of the whole buffer, too large to go inline;
    # its steps inside hosts never count
    t = terms("rechd", 1, TWO_HOSTS, 256, inline=128)
    assert (t.l_net, t.l_inline) == (1, 0)
    assert terms("rechd", 1, TWO_HOSTS, 256, inline=256).l_inline == 1
    # pscpu#2: pieces of n/2; shm/xring: the leaders' ring of n/2 chunks
    assert terms("pscpu", 2, TWO_HOSTS, 256, inline=128).l_inline > 0
    assert terms("pscpu", 2, TWO_HOSTS, 1024, inline=128).l_inline == 0
    leaders = terms("shm/xring", 1, TWO_HOSTS, 256, inline=128)
    assert leaders.l_inline == leaders.l_net == 2
    # no inline size: nothing counts; a saving takes its part off the inline messages
    # only
    assert terms("xring", 2, TWO_HOSTS, 256).l_inline == 0
    t = terms("xring", 2, TWO_HOSTS, 256, inline=128)
    assert t.features(256, 0.5)[2] == pytest.approx(6)
    t = terms("xring", 2, TWO_HOSTS, 4 * KiB, inline=128)
    assert t.features(4 * KiB, 0.5)[2] == pytest.approx(12)
    # the counted form of the shuffle (large jobs) agrees
    assert terms("pscpu", 1, Layout.per_host(8192, 8), 256, inline=128).l_inline == 0
    big = terms("pscpu", 8192, Layout.per_host(8192, 8), 64 * KiB, inline=128)
    assert big.l_inline == big.l_net > 0


def test_an_inline_size_is_found_and_kept():
    # the links pass messages of at most 128 B for half the cost of others
    labels = ["xring", "xring#2", "rechd", "pscpu#2", "shm/xring"]
    truth = {label: costmodel.Fit(label, *_alg_shards(label), *TRUE, inline=128,
                                  inline_saving=0.5) for label in labels}

    def sweep(layout):
        return Sweep(tuple(point(label, n, truth[label].time(n, layout))
                           for label in labels for n in SIZES), layout)

    sweeps = [sweep(TWO_HOSTS), sweep(ONE_HOST)]
    model = costmodel.fit_sweeps(sweeps, bursts=(0,))
    assert model.inline == (128, 0.5)
    for f in model.fits:
        assert f.params == pytest.approx(TRUE, rel=1e-6), f.label
        assert f.max_error < 1e-6, f.label
    # without it, the small sizes of the forms with small messages miss
    plain = costmodel.fit_sweeps(sweeps, bursts=(0,), inlines=((0, 0.0),))
    assert plain.inline == (0, 0.0) and max(f.max_error for f in plain.fits) > 0.05
    text = "\n".join(model.lines())
    assert "a_net*(L_net - 0.5*L_inline) (L_inline: the messages of at most 128 B" in text
    xring2 = next(f for f in model.fits if f.label == "xring#2")
    assert "(12 - 0.5 x 12 inline) x 90 us" in xring2.formula(TWO_HOSTS, 256)
    assert "inline" not in xring2.formula(TWO_HOSTS, MiB)
    # kept in the saved model and in predictions
    loaded = costmodel.CostModel.from_dict(model.as_dict(), "fit.json")
    assert loaded.inline == (128, 0.5)
    prediction = costmodel.predict(loaded, 16, 4, [256, MiB])
    assert "(messages of at most 128 B inline)" in prediction.lines()[0]
    assert "a_net*(L_net-s*L_inline)" in "\n".join(prediction.lines())
    assert prediction.as_dict()["inline_bytes"] == 128
    # an exact plain fit stays without one
    exact = costmodel.fit_sweeps([Sweep(tuple(synthetic(TWO_HOSTS, labels=labels)), TWO_HOSTS),
                                  Sweep(tuple(synthetic(ONE_HOST, labels=labels)), ONE_HOST)])
    assert exact.inline == (0, 0.0) and "L_inline" not in "\n".join(exact.lines())


def _alg_shards(label):
    alg, _, shards = label.partition("#")
    return alg, int(shards or 1)


def test_a_disturbed_size_does_not_drag_the_fit():
    # two sizes measured while the machine was busy (5x): the absolute-error fit keeps
    # the line through the others, least squares would not
    sizes = [256 << (2 * i) for i in range(10)]
    times = [30e-6 + 8e-9 * n for n in sizes]
    times[4] *= 5
    times[5] *= 5
    assert costmodel.fit_points(sizes, times, robust=True) == pytest.approx((30e-6, 8e-9),
                                                                           rel=1e-3)
    a, b = costmodel.fit_points(sizes, times)
    assert b > 8.4e-9  # least squares: 6 % high on every large size


def test_one_layout_shares_each_parameter_between_levels():
    model = costmodel.fit(synthetic(TWO_HOSTS, labels=["rechd"]), 4, 2)
    (f,) = model.fits
    assert set(f.shared) == {"alpha", "beta"}
    assert f.alpha_in == f.alpha_net and f.beta_in == f.beta_net
    assert f.max_error < 0.05  # one line through both levels: still close on the sweep
    assert "=" in model.lines()[2]
    # a flat ring on two hosts has no step inside a host: alpha_in/beta_in follow the net
    (ring,) = costmodel.fit(synthetic(TWO_HOSTS, labels=["xring"]), 4, 2).fits
    assert ring.alpha_net == pytest.approx(TRUE[2]) and ring.beta_net == pytest.approx(TRUE[3])
    assert ring.alpha_in == ring.alpha_net


def test_prediction_writes_the_model_out():
    one, two = synthetic(ONE_HOST), synthetic(TWO_HOSTS)
    model = costmodel.fit_sweeps([Sweep(tuple(two), TWO_HOSTS), Sweep(tuple(one), ONE_HOST)])
    prediction = costmodel.predict(model, 1024, 8, [4, MiB, 64 * MiB])
    assert prediction.nodes == 128
    assert prediction.times["xring"][0] == pytest.approx(TRUE[2] * 2046)
    assert prediction.times["rechd"][2] == pytest.approx(
        TRUE[0] * 6 + TRUE[1] * 1.75 * 64 * MiB + TRUE[2] * 14
        + TRUE[3] * 2 * 127 / 128 * 64 * MiB)
    text = "\n".join(prediction.lines())
    assert "1024 ranks, 8 per host (128 hosts x 8)" in prediction.lines()[0]
    assert "# rechd: t = 6 x 8 us + 1.75 n x 0.25 ns/B inside hosts + 14 x 90 us" in text
    assert "(8 rank(s) of a host on its link at once)" in text
    assert "across links" in text and "b_net*B_net*n" in text and "net share" in text
    record = prediction.as_dict()
    assert record["terms"]["rechd"][2][:4] == pytest.approx([6, 1.75, 14, 2 * 127 / 128])


def test_saved_model_checks_a_validation_sweep(tmp_path):
    one, two = synthetic(ONE_HOST), synthetic(TWO_HOSTS)
    model = costmodel.fit_sweeps([Sweep(tuple(two), TWO_HOSTS), Sweep(tuple(one), ONE_HOST)])
    loaded = costmodel.CostModel.from_dict(model.as_dict(), "fit.json")
    assert [f.params for f in loaded.fits] == [f.params for f in model.fits]
    slower = [point(p.label, p.nbytes, p.median * 1.2) for p in two]
    checked = loaded.checked_against([Sweep(tuple(slower), TWO_HOSTS, "validation")])
    assert all(e == pytest.approx(1 / 1.2 - 1) for f in checked.fits
               for e in [c.error for c in f.checks])
    # through files, as the CLI does: --model-with and --model-from
    meta_one = {"ranks": 4, "nodes": 1, "hostnames_by_rank": ["n1"] * 4}
    meta_two = {"ranks": 4, "nodes": 2, "hostnames_by_rank": ["n1", "n1", "n2", "n2"]}
    write_json(tmp_path / "one.json", meta_one, one, complete=True)
    fitted = costmodel.model_for_run(meta_two, two, model_with=[str(tmp_path / "one.json")])
    assert fitted.fits[0].params == pytest.approx(TRUE, rel=1e-6)
    write_json(tmp_path / "fit.json", meta_two, two, complete=True,
               extra={"cost_model": fitted.as_dict()})
    again = costmodel.model_for_run(meta_two, slower, model_from=str(tmp_path / "fit.json"))
    assert again.fits[0].checks[0].error == pytest.approx(1 / 1.2 - 1)
    write_json(tmp_path / "old.json", meta_two, two, complete=True,
               extra={"cost_model": {"ranks": 4, "nodes": 2, "fits": []}})
    with pytest.raises(ValueError, match="no two-level cost model"):
        costmodel.model_for_run(meta_two, two, model_from=str(tmp_path / "old.json"))


# ------------------------------------------------------------------ metadata


def test_hosts_and_link_metadata():
    assert parse_rate("1gbit") == 1e9 and parse_rate("500mbit") == 5e8
    assert parse_rate("100mbps") == 8e8 and parse_rate("fast") is None
    assert parse_rate(None) is None
    net = network({"MPISTRAT_LINK_RATE": "1gbit", "FI_PROVIDER": "tcp",
                   "MPIR_CVAR_CH4_NETMOD": "ofi"})
    assert net["link_rate"] == "1gbit" and net["link_bits_per_s"] == 1e9
    assert net["transport"] == {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
    assert network({})["link_rate"] is None
    layout = hosts_layout(["node1", "node1", "node2", "node1"])
    assert layout == {"count": 2, "names": ["node1", "node2"], "ranks_per_host": [3, 1],
                      "host_of_rank": [0, 0, 1, 0]}
    meta = {"mpistrat": "0", "ranks": 4, "nodes": 2, "hosts": ["node1", "node2"],
            "mpi_library": "MPICH", "host_layout": layout, "network": net,
            "options": {"replicas_per_rank": 1, "dtype": "float32", "op": "sum",
                        "size_range": "4 B", "warmup": 1, "iters": 1, "check": "x",
                        "entries": ["native"]}}
    lines = describe_run(meta)
    assert ("# hosts: 2 (node1 x3, node2 x1); links 1gbit each (MPISTRAT_LINK_RATE); "
            "MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp") in lines
    assert net["link_mtu"] is None
    meta["network"] = network({"MPISTRAT_LINK_RATE": "1gbit", "MPISTRAT_LINK_MTU": "9000"})
    assert meta["network"]["link_mtu"] == 9000
    assert ("# hosts: 2 (node1 x3, node2 x1); links 1gbit each (MPISTRAT_LINK_RATE), "
            "MTU 9000") in describe_run(meta)
    assert network({"MPISTRAT_LINK_MTU": "big"})["link_mtu"] is None
    meta["network"] = network({"MPISTRAT_LINK_RATE": "off"})
    assert "links unshaped (MPISTRAT_LINK_RATE=off)" in describe_run(meta)[3]
    meta["network"] = network({})
    assert any("link rate unknown (set MPISTRAT_LINK_RATE)" in line
               for line in describe_run(meta))


# ------------------------------------------------------------------ the command


def test_bench_command_fits_two_levels_and_checks_a_saved_model(tmp_path):
    from click.testing import CliRunner

    from mpistrat.cli import cli

    options = {"dtype": "float32", "op": "sum", "replicas_per_rank": 1, "size_range": "x",
               "warmup": 1, "iters": 1, "check": "x", "entries": LABELS}
    base = {"mpistrat": "0", "mpi_library": "MPICH", "argv": ["mpistrat", "bench"],
            "options": options}
    one = {**base, "ranks": 4, "nodes": 1, "hosts": ["n1"], "hostnames_by_rank": ["n1"] * 4}
    two = {**base, "ranks": 4, "nodes": 2, "hosts": ["n1", "n2"],
           "hostnames_by_rank": ["n1", "n1", "n2", "n2"],
           "host_layout": hosts_layout(["n1", "n1", "n2", "n2"]),
           "network": network({"MPISTRAT_LINK_RATE": "1gbit"})}
    write_json(tmp_path / "one.json", one, synthetic(ONE_HOST), complete=True)
    write_json(tmp_path / "two.json", two, synthetic(TWO_HOSTS), complete=True)

    def bench(*args):
        return CliRunner().invoke(cli, ["bench", *args], prog_name="mpistrat")

    result = bench("--from-json", str(tmp_path / "two.json"), "--model-with",
                   str(tmp_path / "one.json"), "--model", "--predict-ranks", "1024",
                   "--predict-ranks-per-node", "8", "--json", str(tmp_path / "fit.json"))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "# hosts: 2 (n1 x2, n2 x2); links 1gbit each (MPISTRAT_LINK_RATE)" in out
    assert "fitted on the medians of: 2 hosts x 2 (this sweep); 1 host x 4 (one.json)" in out
    assert "err 2 hosts x 2" in out and "err 1 host x 4" in out
    assert "# Model error per size on 2 hosts x 2 (model / measured - 1)" in out
    assert "at 1024 ranks, 8 per host (128 hosts x 8)" in out
    assert "# shm/rechd: t = " in out
    saved = json.loads((tmp_path / "fit.json").read_text())
    assert saved["cost_model"]["fits"][0]["alpha_net_s"] == pytest.approx(TRUE[2])
    # the saved model against another sweep: nothing refitted, its errors printed
    result = bench("--from-json", str(tmp_path / "two.json"), "--model-from",
                   str(tmp_path / "fit.json"), "--model")
    assert result.exit_code == 0, result.output
    assert "saved in fit.json, checked against the medians of: 2 hosts x 2 (this sweep)" \
        in result.output
    # validation on several sweeps: repeats of one layout count as their median
    write_json(tmp_path / "two-again.json", two, [point(p.label, p.nbytes, p.median * 1.5)
                                                  for p in synthetic(TWO_HOSTS)], complete=True)
    write_json(tmp_path / "two-more.json", two, [point(p.label, p.nbytes, p.median * 1.1)
                                                 for p in synthetic(TWO_HOSTS)], complete=True)
    result = bench("--from-json", str(tmp_path / "two.json"), "--model-from",
                   str(tmp_path / "fit.json"), "--model-with", str(tmp_path / "one.json"),
                   "--model-with", str(tmp_path / "two-again.json"), "--model-with",
                   str(tmp_path / "two-more.json"), "--model")
    assert result.exit_code == 0, result.output
    assert "2 hosts x 2 (this sweep, two-again.json, two-more.json)" in result.output
    errors = result.output.split("# Model error per size on 2 hosts x 2")[1]
    assert "-9%" in errors.splitlines()[2]  # the median of 1, 1.5 and 1.1 times the model
    result = bench("--from-json", str(tmp_path / "two.json"), "--model-with",
                   str(tmp_path / "missing.json"))
    assert result.exit_code == 2 and "--model-with" in result.output
