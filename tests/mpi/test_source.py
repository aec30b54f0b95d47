"""Out-of-place all-reduce from a :class:`~mpistrat.algorithms.Source` (tensors where they
lie): every algorithm must give the same bits as its in-place run on the concatenated
buffer, write every element of the output, and leave the source arrays untouched."""

from __future__ import annotations

import numpy as np
import pytest
from _checks import digest, finish

from mpistrat import ReduceOp, algorithms, dispatch
from mpistrat.algorithms import Source
from mpistrat.backends import get_backend

ALGORITHMS = ["xring", "xring#2", "rechd", "native", "pscpu", "pscpu#2", "pscpu/pscpu", "shm",
              "shm/rechd"]

# segment sizes (elements): one segment; many small ones around a large one (staged runs
# and direct messages, cut anywhere by the algorithms' chunk bounds); empty segments; a
# buffer shorter than the rank count; sizes across rechd's short-buffer threshold
LAYOUTS = {
    "one": [70_001],
    "mixed": [5, 0, 300, 70_000, 17, 1, 0, 2_000, 65_536, 3, 9],
    "small-only": [7, 1, 13, 200, 3],
    "tiny": [1, 1],
    "short": [100, 200, 111],
    "large-only": [70_000, 65_537, 80_000],
}


def _segments(layout: list[int], rank: int, dtype: np.dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 + rank)
    out = []
    for count in layout:
        if dtype.kind == "f":
            out.append(rng.standard_normal(count).astype(dtype))
        else:
            out.append(rng.integers(-50, 50, count).astype(dtype))
    return out


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MAX])
@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", ALGORITHMS)
def test_source_matches_in_place(comm, name, layout, dtype, op):
    alg, _, shards = name.partition("#")
    shards = int(shards or 1)
    size = comm.Get_size()
    if algorithms.get(alg).pool is not None and shards > size:
        pytest.skip(f"{name} needs at least {shards} ranks")
    segments = _segments(LAYOUTS[layout], comm.Get_rank(), np.dtype(dtype))
    originals = [s.copy() for s in segments]
    backend = get_backend(segments[0])
    flat = np.concatenate(segments)
    dispatch.run(alg, comm, flat, op=op, shards=shards, backend=backend)
    out = np.full(flat.size, 99, dtype=dtype)  # garbage the algorithm must overwrite
    dispatch.run(alg, comm, out, op=op, shards=shards, backend=backend,
                   source=Source(segments, coalesce_bytes=1024))
    problems = []
    if not np.array_equal(out, flat):
        problems.append(f"{name} {layout}: out-of-place differs from in-place at "
                        f"{np.flatnonzero(out != flat)[:5]}")
    if not all(np.array_equal(a, b) for a, b in zip(segments, originals)):
        problems.append(f"{name} {layout}: the source arrays were modified")
    finish(comm, problems, [(f"{name}/{layout}", digest(out))])


JOIN_LAYOUT = [300_000, 5, 0, 17, 70_000, 1]  # float32: 1.48 MB, above JOIN_BYTES


def _one_buffer(segments: list[np.ndarray]) -> list[np.ndarray]:
    """The same values as views of one array, in order (a flat gradient buffer)."""
    flat = np.concatenate(segments)
    out, at = [], 0
    for s in segments:
        out.append(flat[at:at + s.size])
        at += s.size
    return out


@pytest.mark.parametrize("who", ["all", "rank0", "none"])
@pytest.mark.parametrize("name", ["xring", "rechd", "native", "shm", "pscpu", "pscpu/pscpu"])
def test_tensors_in_one_buffer(comm, name, who):
    """Tensors that are views of one buffer travel as that buffer when every rank has
    them so (agreed), else tensor by tensor; ranks may differ; the bits are the same."""
    rank = comm.Get_rank()
    segments = _segments(JOIN_LAYOUT, rank, np.dtype("float32"))
    joined = {"all": True, "rank0": rank == 0, "none": False}[who]
    if joined:
        segments = _one_buffer(segments)
    backend = get_backend(segments[0])
    flat = np.concatenate(segments)
    dispatch.run(name, comm, flat, op=ReduceOp.SUM, backend=backend)
    source = Source(segments)
    out = np.full(flat.size, 99, dtype=np.float32)
    dispatch.run(name, comm, out, op=ReduceOp.SUM, backend=backend, source=source)
    problems = []
    if not np.array_equal(out, flat):
        problems.append(f"{name} {who}: differs from in place at {np.flatnonzero(out != flat)[:5]}")
    if (source.joined() is not None) != joined:
        problems.append(f"{name} {who}: joined() is {source.joined() is not None}")
    agreed = algorithms.source.agreed_join(comm, source, backend).contiguous
    if agreed != (who == "all" or comm.Get_size() == 1 and joined):
        problems.append(f"{name} {who}: agreed contiguous={agreed}")
    finish(comm, problems, [(f"{name}/{who}", digest(out))])


def test_joined_views():
    """Only views that follow one another in one array's memory, in order, join."""
    base = np.arange(40, dtype=np.float32)
    assert np.array_equal(Source([base[:5], base[5:12], base[12:]]).joined(), base)
    assert Source([base[:5], base[6:12]]).joined() is None  # a gap
    assert Source([base[5:12], base[:5]]).joined() is None  # out of order
    assert Source([base[:5].copy(), base[5:12]]).joined() is None  # another array
    two_d = base.reshape(4, 10)
    joined = Source([two_d[0], two_d[1], two_d[2:].reshape(-1)]).joined()
    assert joined is not None and joined.size == 40 and not joined.flags.writeable


def test_source_messages_split():
    """Large pieces travel alone, runs of small ones together; boundaries cut anywhere."""
    segments = [np.zeros(n, np.float32) for n in (10, 20, 1000, 5, 5, 2000, 1)]
    source = Source(segments, coalesce_bytes=1000)  # 1000 and 2000 elements are large
    assert source.messages(0, source.size) == [
        (0, 30, True), (30, 1030, False), (1030, 1040, True), (1040, 3040, False),
        (3040, 3041, True)]
    assert source.messages(25, 1035) == [(25, 30, True), (30, 1030, False), (1030, 1035, True)]
    assert source.messages(100, 100) == []
    assert Source.of(np.zeros(50, np.float32)).messages(10, 20) == [(10, 20, False)]
    # max_bytes cuts longer messages into near-equal ones, staged runs too
    assert source.messages(25, 1035, max_bytes=1600) == [
        (25, 30, True), (30, 363, False), (363, 696, False), (696, 1030, False),
        (1030, 1035, True)]
    assert source.messages(0, 30, max_bytes=40) == [(0, 10, True), (10, 20, True),
                                                      (20, 30, True)]


@pytest.mark.parametrize("layout", ["mixed", "large-only", "short"])
def test_rechd_in_pieces(comm, layout, monkeypatch):
    """rechd's last halving step in many pieces, each sent back as soon as it is reduced:
    in place and out of place equal the exact integer sum."""
    from mpistrat.algorithms import halving_doubling

    monkeypatch.setattr(halving_doubling, "PIPELINE_BYTES", 4000)
    segments = _segments(LAYOUTS[layout], comm.Get_rank(), np.dtype("int64"))
    backend = get_backend(segments[0])
    flat = np.concatenate(segments)
    expected = np.sum(comm.allgather(flat), axis=0)
    dispatch.run("rechd", comm, flat, op=ReduceOp.SUM, backend=backend)
    out = np.full(flat.size, 99, dtype=np.int64)
    dispatch.run("rechd", comm, out, op=ReduceOp.SUM, backend=backend,
                   source=Source(segments, coalesce_bytes=2048))
    problems = [f"{label} differs from the sum" for label, got in
                (("in place", flat), ("out of place", out)) if not np.array_equal(got, expected)]
    finish(comm, problems, [(layout, digest(out))])


@pytest.mark.parametrize("shards", [1, 2, 3])
@pytest.mark.parametrize("layout", ["mixed", "large-only", "short"])
def test_pscpu_in_pieces(comm, layout, shards, monkeypatch):
    """pscpu's pieces in many messages, each added as it lands and sent back at once: in
    place, out of place and reduced to a root all equal the exact integer sum."""
    from mpistrat.algorithms import shuffle

    if shards > comm.Get_size():
        pytest.skip(f"pscpu#{shards} needs at least {shards} ranks")
    monkeypatch.setattr(shuffle, "PIECE_BYTES", 4000)
    segments = _segments(LAYOUTS[layout], comm.Get_rank(), np.dtype("int64"))
    backend = get_backend(segments[0])
    flat = np.concatenate(segments)
    expected = np.sum(comm.allgather(flat), axis=0)
    in_place = flat.copy()
    dispatch.run("pscpu", comm, in_place, op=ReduceOp.SUM, shards=shards, backend=backend)
    out = np.full(flat.size, 99, dtype=np.int64)
    dispatch.run("pscpu", comm, out, op=ReduceOp.SUM, shards=shards, backend=backend,
                   source=Source(segments, coalesce_bytes=2048))
    root = comm.Get_size() - 1
    rooted = np.full(flat.size, 99, dtype=np.int64)
    shuffle.reduce_to_root(comm, rooted, op=ReduceOp.SUM, backend=backend, root=root,
                           source=Source(segments, coalesce_bytes=2048))
    rooted_in_place = flat.copy()
    shuffle.reduce_to_root(comm, rooted_in_place, op=ReduceOp.SUM, backend=backend, root=root)
    results = [("in place", in_place), ("out of place", out)]
    if comm.Get_rank() == root:
        results += [("to the root", rooted), ("to the root in place", rooted_in_place)]
    problems = [f"{label} differs from the sum" for label, got in results
                if not np.array_equal(got, expected)]
    finish(comm, problems, [(layout, digest(out))])
