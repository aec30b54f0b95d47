"""``mpistrat.torch.store.MPIStore``: torch's key-value store over MPI (no socket).

Every rank of the communicator under test (``COMM_WORLD``, a ``Dup``, a ``Split`` half)
shares one store, held by its rank 0 and served to the others by a thread there: values
set on one rank are read on every rank, counters add up across ranks, ``compare_set``
has one winner, blocking calls wait for keys set later and time out naming the keys,
``PrefixStore`` works over it (including the calls torch makes from C++), limits and
malformed requests give clear errors without stopping the server, and gloo meets
through it and all-reduces.
"""

from __future__ import annotations

import struct
import threading
import time
import types
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from mpistrat.torch import store as store_module  # noqa: E402
from mpistrat.torch.store import (  # noqa: E402
    MAX_KEY_BYTES,
    MAX_VALUE_BYTES,
    MPIStore,
    MPIStoreError,
)

MPI = pytest.importorskip("mpi4py.MPI")


@pytest.fixture
def store(comm):
    s = MPIStore(comm, timeout=timedelta(seconds=30))
    yield s
    s.close()


def test_is_a_torch_store_raising_torch_errors(store):
    assert isinstance(store, dist.Store)
    assert issubclass(MPIStoreError, dist.DistStoreError)
    assert store.timeout == timedelta(seconds=30)
    store.set_timeout(timedelta(seconds=5))
    assert store.timeout == timedelta(seconds=5)
    assert store.clone() is store
    assert store.has_extended_api()


def test_set_get_across_ranks(comm, store):
    rank, size = comm.rank, comm.size
    raw = bytes(range(256)) * 3 + bytes([rank])  # any bytes travel, NULs and non-UTF-8
    store.set(f"raw/{rank}", raw)
    store.set(f"text/{rank}", f"rank {rank}")
    for other in range(size):
        assert store.get(f"raw/{other}") == bytes(range(256)) * 3 + bytes([other])
        assert store.get(f"text/{other}") == f"rank {other}".encode()
    comm.Barrier()
    store.set("shared", "first")  # every rank overwrites: one of them stays
    comm.Barrier()
    assert store.get("shared") == b"first"
    store.set("", b"")  # the empty key and the empty value are ordinary ones
    assert store.get("") == b""


def test_get_waits_for_a_key_set_later(comm, store):
    assert not store.check(["late"])
    comm.Barrier()  # nobody sets the key before every rank has seen it missing
    if comm.rank == comm.size - 1:
        time.sleep(0.3)
        store.set("late", b"here")
    assert store.get("late") == b"here"
    assert store.multi_get(["late", "late"]) == [b"here", b"here"]


def test_add_counts_every_rank(comm, store):
    rank, size = comm.rank, comm.size
    seen = [store.add("counter", rank + 1) for _ in range(5)]
    assert seen == sorted(seen) and len(set(seen)) == 5, seen
    comm.Barrier()
    total = 5 * size * (size + 1) // 2
    assert store.add("counter", 0) == total
    assert store.get("counter") == str(total).encode()  # decimal text, as torch's stores
    assert store.add(f"down/{rank}", -7) == -7
    all_seen = sorted(v for values in comm.allgather(seen) for v in values)
    assert all_seen[-1] == total and len(set(all_seen)) == 5 * size
    store.set(f"text/{rank}", "not a number")
    with pytest.raises(ValueError, match=r"not an integer counter"):
        store.add(f"text/{rank}", 1)
    with pytest.raises(TypeError, match=r"must be an int"):
        store.add("counter", 1.5)


def test_compare_set_has_one_winner(comm, store):
    rank, size = comm.rank, comm.size
    got = store.compare_set("owner", "", f"rank {rank}")
    results = comm.allgather(got)
    winners = [r for r, value in enumerate(results) if value == f"rank {r}".encode()]
    assert len(winners) == 1, results
    assert set(results) == {f"rank {winners[0]}".encode()}
    comm.Barrier()
    assert store.get("owner") == f"rank {winners[0]}".encode()
    # a missing key matches only the empty expected value, and stays missing otherwise
    assert store.compare_set(f"absent/{rank}", "something", "new") == b"something"
    assert not store.check([f"absent/{rank}"])
    # a matching expected value swaps; a stale one returns the current value
    store.set(f"mine/{rank}", "a")
    assert store.compare_set(f"mine/{rank}", "a", "b") == b"b"
    assert store.compare_set(f"mine/{rank}", "a", "c") == b"b"
    assert store.get(f"mine/{rank}") == b"b"
    del size


def test_wait_and_get_time_out_naming_the_keys(comm, store):
    rank = comm.rank
    store.set(f"present/{rank}", "x")
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match=rf"'missing/{rank}'") as caught:
        store.wait([f"present/{rank}", f"missing/{rank}"], timedelta(seconds=0.3))
    waited = time.monotonic() - start
    assert 0.25 < waited < 10, waited
    assert f"present/{rank}" not in str(caught.value)  # only the missing key is named
    assert "timed out after 0.3 s" in str(caught.value)
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(MPIStoreError, match=rf"get on rank {rank} .*'absent/{rank}'"):
        store.get(f"absent/{rank}")
    with pytest.raises(MPIStoreError, match=rf"'gone/{rank}'"):
        store.wait([f"gone/{rank}"])  # the store's timeout
    with pytest.raises(MPIStoreError, match=rf"'nothing/{rank}'"):
        store.multi_get([f"present/{rank}", f"nothing/{rank}"])
    store.wait([f"present/{rank}"])  # present keys do not wait
    store.wait([])


def test_check_delete_num_keys(comm, store):
    rank, size = comm.rank, comm.size
    store.set(f"k/{rank}", str(rank))
    comm.Barrier()
    assert store.num_keys() == size
    assert store.check([f"k/{r}" for r in range(size)])
    assert not store.check([f"k/{r}" for r in range(size + 1)])
    assert store.check([])
    comm.Barrier()
    if rank == size - 1:
        assert store.delete_key("k/0") is True
        assert store.delete_key("k/0") is False
    comm.Barrier()
    assert not store.check(["k/0"])
    assert store.num_keys() == size - 1
    assert store.delete_key("never/set") is False


def test_multi_set_multi_get_append(comm, store):
    rank, size = comm.rank, comm.size
    store.multi_set([f"m/{rank}/a", f"m/{rank}/b"], [b"A", "B"])
    store.append("log", f"<{rank}>")
    store.append(f"own/{rank}", "x")
    store.append(f"own/{rank}", b"y")
    comm.Barrier()
    keys = [f"m/{r}/{c}" for r in range(size) for c in "ab"]
    assert store.multi_get(keys) == [b"A", b"B"] * size
    log = store.get("log").decode()
    assert sorted(log.split(">")[:-1]) == sorted(f"<{r}" for r in range(size)), log
    assert store.get(f"own/{rank}") == b"xy"
    with pytest.raises(ValueError, match=r"one value per key"):
        store.multi_set(["a", "b"], ["1"])


def test_prefix_store_over_it(comm, store):
    """torch's PrefixStore calls the store from C++: set, get, add, compare_set, check,
    wait, multi_get, multi_set, append under their Python names, num_keys and delete_key
    under their C++ ones (getNumKeys, deleteKey)."""
    rank, size = comm.rank, comm.size
    prefixed = dist.PrefixStore("job", store)
    nested = dist.PrefixStore("inner", prefixed)
    prefixed.set(f"k/{rank}", f"v{rank}")
    nested.set(f"n/{rank}", f"w{rank}")
    prefixed.add("count", 1)
    comm.Barrier()
    assert prefixed.num_keys() == 2 * size + 1  # every key of the store, as torch's stores
    comm.Barrier()
    for other in range(size):
        assert store.get(f"job/k/{other}") == f"v{other}".encode()
        assert prefixed.get(f"k/{other}") == f"v{other}".encode()
        assert store.get(f"job/inner/n/{other}") == f"w{other}".encode()
        assert nested.get(f"n/{other}") == f"w{other}".encode()
    assert prefixed.get("count") == str(size).encode()
    assert prefixed.check([f"k/{r}" for r in range(size)])
    prefixed.wait([f"k/{r}" for r in range(size)])
    prefixed.wait([f"k/{r}" for r in range(size)], timedelta(seconds=5))
    with pytest.raises(dist.DistStoreError, match=rf"'job/missing/{rank}'"):
        prefixed.wait([f"missing/{rank}"], timedelta(seconds=0.2))
    prefixed.multi_set([f"ms/{rank}"], [b"z"])
    assert prefixed.multi_get([f"ms/{rank}", f"k/{rank}"]) == [b"z", f"v{rank}".encode()]
    prefixed.append(f"ap/{rank}", "1")
    prefixed.append(f"ap/{rank}", "2")
    assert store.get(f"job/ap/{rank}") == b"12"
    assert prefixed.compare_set(f"ap/{rank}", "12", "done") == b"done"
    assert prefixed.delete_key(f"ap/{rank}") is True
    assert prefixed.delete_key(f"ap/{rank}") is False
    assert not store.check([f"job/ap/{rank}"])
    comm.Barrier()


def test_limits(comm, store):
    rank, size = comm.rank, comm.size
    with pytest.raises(ValueError, match=rf"over the limit of {MAX_KEY_BYTES} bytes"):
        store.set("k" * (MAX_KEY_BYTES + 1), b"")
    with pytest.raises(ValueError, match=rf"over the limit of {MAX_KEY_BYTES} bytes"):
        store.get("é" * (MAX_KEY_BYTES // 2 + 1))  # bytes, not characters
    with pytest.raises(ValueError, match=rf"over the limit of {MAX_VALUE_BYTES} bytes"):
        store.set("big", bytes(MAX_VALUE_BYTES + 1))
    with pytest.raises(TypeError, match=r"keys are str"):
        store.set(3, b"")
    with pytest.raises(TypeError, match=r"a list of keys"):
        store.check("single")
    with pytest.raises(TypeError, match=r"timedelta"):
        store.wait(["k"], 5)
    store.set("k" * MAX_KEY_BYTES, f"{rank}")  # exactly the limit
    if rank == size - 1:
        store.set("largest", bytes(range(256)) * (MAX_VALUE_BYTES // 256))
        store.append("grows", bytes(MAX_VALUE_BYTES - 1))
        with pytest.raises(ValueError, match=r"would grow to .* over the limit"):
            store.append("grows", b"12")
    largest = store.get("largest")
    assert len(largest) == MAX_VALUE_BYTES and largest[:256] == bytes(range(256))
    del largest
    comm.Barrier()


def _reply(comm, tag):
    status = MPI.Status()
    comm.Probe(source=0, tag=tag, status=status)
    buffer = bytearray(status.Get_count(MPI.BYTE))
    comm.Recv([buffer, MPI.BYTE], source=0, tag=tag)
    request, code, count = struct.unpack_from("<QBI", buffer, 0)
    return request, code, buffer[struct.calcsize("<QBI") + 8:].decode(errors="replace")


def test_malformed_requests_get_error_replies(capfd, comm, store):
    """Requests sent around the client on the store's own communicator: an unknown
    operation, a field that overruns the message, wrong field counts and oversized
    keys get error replies; a message too short to name its reply tag is dropped with a
    line on stderr. The server keeps serving."""
    own = store._comm
    header = struct.Struct("<QIBqI")
    length = struct.Struct("<Q")
    tag = 30000
    if comm.rank != 0:
        bad = {
            "unknown op": header.pack(901, tag, 99, 0, 0),
            "overrun": header.pack(902, tag, 2, 0, 1) + length.pack(50) + b"short",
            "field count": header.pack(903, tag, 1, 0, 1) + length.pack(1) + b"k",
            "big key": header.pack(904, tag, 6, 0, 1) + length.pack(MAX_KEY_BYTES + 1)
            + bytes(MAX_KEY_BYTES + 1),
            "trailing": header.pack(905, tag, 8, 0, 0) + b"junk",
            "bad amount": header.pack(906, tag, 3, 0, 2) + length.pack(1) + b"c"
            + length.pack(3) + b"abc",
        }
        for what, message in bad.items():
            own.Send([message, MPI.BYTE], dest=0, tag=1)
            request, code, text = _reply(own, tag)
            assert request == 901 + list(bad).index(what)
            assert code != 0, (what, text)
            assert "MPIStore" in text or "limit" in text, (what, text)
    comm.Barrier()  # (rank 0 is in the test, capturing stderr, from here)
    if comm.rank != 0:
        own.Send([b"xyz", MPI.BYTE], dest=0, tag=1)  # no header: dropped, with a note
        # an error reply that nobody waits for, on a reply tag the client uses later: the
        # client skips it (its request id is not the client's)
        own.Send([header.pack(907, 7, 1, 0, 0), MPI.BYTE], dest=0, tag=1)
    store.set(f"alive/{comm.rank}", "yes")  # the server still serves
    for other in range(comm.size):
        assert store.get(f"alive/{other}") == b"yes"
    for _ in range(8):  # reply tags 2, 3, ... up to past 7
        assert store.check([f"alive/{comm.rank}"])
    if comm.rank == 0 and comm.size > 1:  # rank 1's set came after its garbage
        assert "dropped a request of 3 bytes from rank 1" in capfd.readouterr().err
    comm.Barrier()


def test_threads_of_one_rank_wait_at_once(comm, store):
    """Several threads per rank in blocking gets at once, each answered on its own."""
    rank, size = comm.rank, comm.size
    threads, results, errors = 4, {}, []

    def worker(t):
        try:
            time.sleep(0.05 * t)
            store.set(f"t{t}/r{rank}", f"{t}:{rank}")
            results[t] = store.get(f"t{threads - 1 - t}/r{(rank + 1) % size}")
        except Exception as exc:  # reported below
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(60)
    assert not errors, errors
    assert results == {t: f"{threads - 1 - t}:{(rank + 1) % size}".encode()
                       for t in range(threads)}


def test_close_fails_waiting_calls_and_later_ones(comm):
    s = MPIStore(comm, timeout=timedelta(0))  # no limit: only close ends the wait
    errors = []

    def blocked():
        try:
            s.get("never")
        except MPIStoreError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=blocked)
    thread.start()
    time.sleep(0.2)
    comm.Barrier()
    s.close()
    thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and "closed" in errors[0], errors
    with pytest.raises(MPIStoreError, match=r"store is closed"):
        s.set("k", "v")
    s.close()  # a second close does nothing


def test_thread_level_below_multiple_is_refused(comm, monkeypatch):
    fake = types.SimpleNamespace(
        Query_thread=lambda: MPI.THREAD_SERIALIZED, THREAD_MULTIPLE=MPI.THREAD_MULTIPLE,
        THREAD_SINGLE=MPI.THREAD_SINGLE, THREAD_FUNNELED=MPI.THREAD_FUNNELED,
        THREAD_SERIALIZED=MPI.THREAD_SERIALIZED)
    monkeypatch.setattr(store_module, "mpi", lambda: fake)
    with pytest.raises(RuntimeError, match=r"MPI_THREAD_MULTIPLE.*MPI_THREAD_SERIALIZED"):
        MPIStore(comm)


def test_bad_arguments(comm):
    with pytest.raises(TypeError, match=r"mpi4py communicator"):
        MPIStore(object())
    with pytest.raises(ValueError, match=r"negative"):
        MPIStore(comm, timeout=timedelta(seconds=-1))


def test_gloo_meets_through_it(comm):
    """gloo's rendezvous through the store (wrapped in torch's PrefixStore by
    init_process_group), then an all_reduce over gloo."""
    if dist.is_initialized():
        pytest.skip("a default process group exists in this process already")
    rank, size = comm.rank, comm.size
    s = MPIStore(comm, timeout=timedelta(seconds=60))
    try:
        dist.init_process_group(backend="gloo", store=s, rank=rank, world_size=size)
        try:
            tensor = torch.tensor([float(rank + 1), 2.0, -float(rank)])
            dist.all_reduce(tensor)
            expected = torch.tensor([size * (size + 1) / 2, 2.0 * size,
                                     -size * (size - 1) / 2])
            assert torch.equal(tensor, expected), (tensor, expected)
            assert dist.get_rank() == rank and dist.get_world_size() == size
            dist.barrier()
        finally:
            dist.destroy_process_group()
    finally:
        s.close()
