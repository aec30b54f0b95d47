"""An elastic job's snapshots at 1-4 ranks (``mpistrat.checkpoint.snapshot``): each host's
writer keeps the state in its own directory (a layout file, two slots each with a commit
record at its head), a restore brings the newest valid snapshot any host holds to every
rank, and every damaged, forged, foreign or planted file is skipped with its reason on every
rank (or the restore finds nothing) — never a traceback on some ranks, a hang, or values
that are not a snapshot's. The checkpoint manager's part: a
snapshot at every step boundary of the distributed dataset, and after a relaunch the
snapshot and the input position restored.

Several hosts are simulated by giving each rank a host name (``socket.gethostname``) before
the store is made: ``host0`` for the lower half of the ranks, ``host1`` for the upper half,
all in one shared temporary directory (the ``root`` of the store).
"""

from __future__ import annotations

import glob
import hashlib
import hmac
import json
import os
import re
import shutil
import socket
import struct
import tempfile
import time
import uuid
import warnings

import numpy as np
import pytest

import mpistrat as ms
from mpistrat import AutoShardPolicy, Dataset, elastic
from mpistrat.checkpoint import Checkpoint, CheckpointManager, Scalar
from mpistrat.checkpoint import _shares
from mpistrat.checkpoint import snapshot as snapshot_module
from mpistrat.checkpoint.snapshot import SnapshotStore
from mpistrat.data import Options
from mpistrat.elastic import hooks
from mpistrat.elastic.env import ElasticEnv, set_job_secret

MPI = pytest.importorskip("mpi4py.MPI")

pytestmark = pytest.mark.timeout(60)

SECRET = b"the job's secret, 32 bytes long!"
KIND = "DistributedDataset/6"


# --- fixtures and helpers -----------------------------------------------------------------


def new_job(comm) -> str:
    return comm.bcast(uuid.uuid4().hex if comm.rank == 0 else None)


def host_of(rank: int, size: int) -> str:
    """host0 for the lower half of the ranks, host1 for the upper (one host at 1 rank)."""
    return f"host{rank * 2 // size}"


@pytest.fixture
def hosts(world, monkeypatch):
    """Every rank on its simulated host (from now on); the list of every rank's host."""
    names = [host_of(r, world.size) for r in range(world.size)]
    monkeypatch.setattr(socket, "gethostname", lambda: names[world.rank])
    return names


class State:
    """One of every kind of leaf: a float32 array, a mirrored variable, a Scalar and a
    generator; ``set(k)`` gives them values that depend on ``k`` only."""

    def __init__(self, comm, variable=True):
        self.w = np.zeros((3, 4), np.float32)
        self.v = None
        if variable:
            strategy = ms.MultiWorkerMirroredStrategy(comm=comm)
            with strategy.scope():
                self.v = ms.Variable(np.zeros((2, 3), np.float64), name="v")
        self.step = Scalar(0)
        self.rng = np.random.default_rng(0)
        objects = {"w": self.w, "step": self.step, "rng": self.rng}
        if variable:
            objects["model"] = {"v": self.v}
        self.checkpoint = Checkpoint(comm=comm, **objects)

    @staticmethod
    def expected(k):
        return (np.arange(12, dtype=np.float32).reshape(3, 4) * k + 0.5,
                np.full((2, 3), 1.25 * k),
                10 * k,
                np.random.default_rng(100 + k).bit_generator.state)

    def set(self, k):
        w, v, step, rng = self.expected(k)
        self.w[...] = w
        if self.v is not None:
            self.v.assign(v)
        self.step.assign(step)
        self.rng.bit_generator.state = rng

    def values(self):
        return (self.w.copy(), None if self.v is None else np.array(self.v.numpy()),
                int(self.step), self.rng.bit_generator.state)

    def holds(self, k) -> bool:
        w, v, step, rng = self.values()
        ew, ev, estep, erng = self.expected(k)
        return (w.dtype == np.float32 and np.array_equal(w, ew)
                and (v is None or np.array_equal(v, ev)) and step == estep and rng == erng)

    def digest(self) -> str:
        w, v, step, rng = self.values()
        parts = [w.tobytes(), b"" if v is None else v.tobytes(), str(step).encode(),
                 json.dumps(rng, sort_keys=True).encode()]
        return hashlib.sha256(b"|".join(parts)).hexdigest()


def make_store(state, job, root, comm, secret=SECRET, restart=0):
    return SnapshotStore(state.checkpoint, ElasticEnv(job, restart, (comm.size,)), secret,
                         comm=comm, root=root)


def two_snapshots(world, root):
    """A fresh job's state and store, with snapshot 1 (the state all 1) and snapshot 2
    (all 2) taken."""
    state = State(world)
    store = make_store(state, new_job(world), root, world)
    state.set(1)
    store.take((KIND, 1))
    state.set(2)
    store.take((KIND, 2))
    return state, store


def same_everywhere(comm, value) -> bool:
    return len({repr(v) for v in comm.allgather(value)}) == 1


def outcome(fn):
    """``fn()``'s result and None, or None and the exception it raised."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001
        return None, exc


def summary(info):
    """What every rank must agree on about a restore."""
    if info is None:
        return None
    return (info.path, info.sequence, info.world_size, info.position, info.skipped)


HEADER = struct.Struct("<8sQQ32s")  # magic, sequence (0: none), record length, HMAC


def header_of(path):
    """(magic, sequence, record length, mac, record bytes) at the head of a slot."""
    with open(path, "rb") as file:
        head = file.read(HEADER.size)
        magic, sequence, length, mac = HEADER.unpack(head)
        return magic, sequence, length, mac, file.read(min(length, 1 << 16))


def slot_holding(directory, sequence):
    """The slot file of ``directory`` whose committed sequence is ``sequence``."""
    found = [os.path.join(directory, f"slot-{i}.data") for i in (0, 1)
             if os.path.exists(os.path.join(directory, f"slot-{i}.data"))
             and header_of(os.path.join(directory, f"slot-{i}.data"))[1] == sequence]
    assert len(found) == 1, (directory, sequence, found)
    return found[0]


def sequences_in(directory):
    return sorted(header_of(os.path.join(directory, name))[1]
                  for name in os.listdir(directory) if name.endswith(".data"))


def layout_body(layout):
    return json.dumps({k: v for k, v in layout.items() if k != "mac"}, sort_keys=True)


def layout_mac(secret, layout):
    """The layout's authentication as the writer makes it (checked against a real one in
    test_the_files_are_authenticated_as_the_tests_assume)."""
    return hmac.new(secret, b"mpistrat-snapshot-layout\0" + layout_body(layout).encode(),
                    hashlib.sha256).hexdigest()


def record_mac(secret, layout, sequence, body):
    digest = hashlib.sha256(layout_body(layout).encode()).digest()
    return hmac.new(secret, b"mpistrat-snapshot\0" + digest + sequence.to_bytes(8, "little")
                    + body, hashlib.sha256).digest()


def read_json(path):
    with open(path) as file:
        return json.load(file)


def replace_file(path, data: bytes):
    os.unlink(path)
    with open(path, "wb") as file:
        file.write(data)


def commit(path, layout, sequence, body: bytes, secret=SECRET, header_sequence=None):
    """Write a commit record into the slot at ``path`` (in place), authenticated under
    ``secret`` as the writer would."""
    header_sequence = sequence if header_sequence is None else header_sequence
    with open(path, "r+b") as file:
        file.write(HEADER.pack(b"MPSNAP01", header_sequence, len(body),
                               record_mac(secret, layout, header_sequence, body)))
        file.write(body)


def host_dirs(store) -> list[str]:
    return sorted(glob.glob(os.path.join(store.job_directory, "*")))

# --- round trips --------------------------------------------------------------------------


def test_round_trip_restores_every_kind_of_leaf_on_every_rank(comm):
    rank, size = comm.rank, comm.size
    root = comm.bcast(tempfile.mkdtemp(prefix="mpistrat-snap-") if rank == 0 else None)
    try:
        state = State(comm)
        store = make_store(state, new_job(comm), root, comm)
        assert store.writer == (rank == 0)  # one real host: its lowest rank writes
        state.set(1)
        state.checkpoint.save_counter = 4
        store.take((KIND, 3))
        assert store.sequence == 1 and store.taken == (1 if rank == 0 else 0)
        state.set(9)
        state.checkpoint.save_counter = 0
        assert state.holds(9) and not state.holds(1)
        info = store.restore()
        assert info is not None
        assert info.sequence == 1 and info.world_size == size and info.position == (KIND, 3)
        assert os.path.dirname(info.path) == store.directory
        assert header_of(info.path)[1] == 1
        assert info.skipped == ()
        assert state.holds(1) and state.checkpoint.save_counter == 4
        assert state.w.dtype == np.float32
        assert same_everywhere(comm, (summary(info), state.digest()))
        store.close()
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)


def test_the_global_generators_resume_on_every_rank(world, root):
    """``random``'s, NumPy's global and torch's default generator in a snapshot: after a
    relaunch that reseeds them (differently on each rank), every rank draws what the
    writer would have drawn next."""
    import random

    torch = pytest.importorskip("torch")
    seed = 10 + world.rank  # (seeded per rank: the restore gives every rank the writer's)
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    random.random(), np.random.randn(), torch.rand(3)
    step = Scalar(0)
    checkpoint = Checkpoint(comm=world, step=step, rng=ms.checkpoint.global_generators())
    store = SnapshotStore(checkpoint, ElasticEnv(new_job(world), 0, (world.size,)), SECRET,
                          comm=world, root=root)
    step.assign(3)
    store.take((KIND, 3))

    def draw():
        return [random.random(), random.gauss(0, 1), float(np.random.rand()),
                float(np.random.randn()), *torch.rand(2).tolist()]

    expected = world.bcast(draw() if world.rank == 0 else None)
    random.seed(99 + world.rank), np.random.seed(99), torch.manual_seed(world.rank)
    step.assign(0)
    info = _outcome_everywhere(world, store)
    assert info is not None and int(step) == 3
    assert draw() == expected
    store.close()


def test_nothing_to_restore_is_none_and_changes_nothing(world, root):
    state = State(world)
    state.set(5)
    store = make_store(state, new_job(world), root, world)
    assert store.restore() is None
    assert state.holds(5) and store.sequence == 0
    store.close()


def test_the_newest_of_two_is_restored_and_the_slots_alternate(world, root):
    state = State(world)
    job = new_job(world)
    store = make_store(state, job, root, world)
    state.set(1)
    store.take((KIND, 1))
    state.set(2)
    store.take((KIND, 2))
    world.Barrier()  # (the writer has written)
    assert sequences_in(store.directory) == [1, 2]  # one slot each
    state.set(9)
    info = store.restore()
    assert info.sequence == 2 and info.position == (KIND, 2) and state.holds(2)
    assert info.path == slot_holding(store.directory, 2)
    state.set(3)
    store.take((KIND, 3))  # overwrites snapshot 1, not the newest
    world.Barrier()
    assert sequences_in(store.directory) == [2, 3]
    state.set(9)
    assert store.restore().sequence == 3 and state.holds(3)
    store.close()

    # a relaunch: a new store (its count at 0) finds snapshot 3 and continues from it
    state2 = State(world)
    store2 = make_store(state2, job, root, world, restart=1)
    assert store2.sequence == 0
    info = store2.restore()
    assert info.sequence == 3 and store2.sequence == 3 and state2.holds(3)
    state2.set(4)
    store2.take((KIND, 4))
    world.Barrier()
    assert sequences_in(store2.directory) == [3, 4]  # the restored one stays
    state2.set(9)
    assert store2.restore().sequence == 4 and state2.holds(4)
    assert same_everywhere(world, state2.digest())
    store2.close(remove=True)
    world.Barrier()
    assert not os.path.exists(store2.job_directory)


def test_a_smaller_launch_restores_what_the_whole_job_took(world, root):
    """Each half of the ranks restores on its own communicator (as fewer ranks would):
    the snapshot's world size is the one that took it."""
    job = new_job(world)
    state = State(world, variable=False)
    store = make_store(state, job, root, world)
    state.set(6)
    store.take((KIND, 5))
    store.close()
    half = world.Split(color=int(world.rank >= (world.size + 1) // 2), key=world.rank)
    try:
        small = State(half, variable=False)
        small.set(0)
        smaller = make_store(small, job, root, half, restart=1)
        assert smaller.writer == (half.rank == 0)
        info = smaller.restore()
        assert info is not None and info.world_size == world.size and info.sequence == 1
        assert info.position == (KIND, 5) and small.holds(6)
        smaller.close()
    finally:
        half.Free()


def test_a_background_copy_holds_the_boundarys_values(world, root):
    """A variable large enough to be copied in the background: the next write to it
    waits for the copy, so the snapshot holds the values at take()."""
    strategy = ms.MultiWorkerMirroredStrategy(comm=world)
    n = snapshot_module.BACKGROUND_BYTES // 4 + 1024
    with strategy.scope():
        big = ms.Variable(np.zeros(n, np.float32))
    checkpoint = Checkpoint(comm=world, big=big)
    store = SnapshotStore(checkpoint, ElasticEnv(new_job(world), 0, (world.size,)), SECRET,
                          comm=world, root=root)
    first = np.arange(n, dtype=np.float32)
    big.assign(first)
    store.take((KIND, 1))
    big.assign(np.full(n, -1, np.float32))  # (waits for the copy)
    big.assign_add(np.full(n, -1, np.float32))
    info = store.restore()  # (waits for the commit)
    assert info.sequence == 1
    np.testing.assert_array_equal(np.asarray(big.numpy()), first)
    store.close()


def flip_last_byte(world, store, name, sequence):
    """Once snapshot ``sequence`` is committed, flip a bit of the last byte of value
    ``name`` in it, on every host (rank 0 does it)."""
    store.wait()
    world.Barrier()
    if world.rank == 0:
        for directory in host_dirs(store):
            layout = store.check_layout(os.path.join(directory, "layout.json"))
            place = next(e for e in layout["entries"] if e["name"] == name)
            with open(slot_holding(directory, sequence), "r+b") as file:
                file.seek(place["offset"] + place["nbytes"] - 1)
                byte = file.read(1)
                file.seek(place["offset"] + place["nbytes"] - 1)
                file.write(bytes([byte[0] ^ 0x80]))
    world.Barrier()


def test_a_large_states_checksums_made_while_copying_find_a_flipped_bit(world, root):
    """A state of more than 1 MiB: each value's checksum is computed as it is copied
    (in take() for an array, in the background for a large variable). Both verify on
    restore, and a bit flipped in either value of the newest slot after its commit
    makes every rank skip that snapshot, naming the value, and restore the one before."""
    strategy = ms.MultiWorkerMirroredStrategy(comm=world)
    n = snapshot_module.BACKGROUND_BYTES // 4 + 1027  # (an odd size: a tail of 4 bytes)
    with strategy.scope():
        big = ms.Variable(np.zeros(n, np.float32))
    table = np.zeros(3 * (512 << 10) // 8 + 3, np.float64)
    checkpoint = Checkpoint(comm=world, big=big, table=table)
    store = SnapshotStore(checkpoint, ElasticEnv(new_job(world), 0, (world.size,)), SECRET,
                          comm=world, root=root)
    for name in ("table", "big"):
        for _ in range(2):  # (a restore goes on from the sequence it restored)
            sequence = store.sequence + 1
            big.assign(np.arange(n, dtype=np.float32) * sequence)
            table[:] = np.arange(table.size) / sequence
            store.take((KIND, sequence))
        flip_last_byte(world, store, name, sequence)
        big.assign(np.zeros(n, np.float32))
        table[:] = 0
        info = _outcome_everywhere(world, store)
        assert info is not None and info.sequence == sequence - 1, summary(info)
        assert any(f"entry '{name}' does not match its checksum" in note
                   for note in info.skipped), info.skipped
        np.testing.assert_array_equal(np.asarray(big.numpy()),
                                      np.arange(n, dtype=np.float32) * (sequence - 1))
        np.testing.assert_array_equal(table, np.arange(table.size) / (sequence - 1))
    store.close()


# --- several hosts ------------------------------------------------------------------------


def test_each_hosts_writer_writes_its_own_directory(world, root, hosts):
    state = State(world)
    store = make_store(state, new_job(world), root, world)
    assert store.writer == (hosts.index(hosts[world.rank]) == world.rank)
    assert os.path.basename(store.directory) == hosts[world.rank]
    state.set(1)
    store.take(None)
    world.Barrier()
    assert sorted(os.listdir(store.job_directory)) == sorted(set(hosts))
    for name in set(hosts):
        directory = os.path.join(store.job_directory, name)
        files = sorted(os.listdir(directory))
        assert files[0] == "layout.json" and len(files) == 2, (name, files)
        assert sequences_in(directory) == [1]
        layout = store.check_layout(os.path.join(directory, "layout.json"))
        assert store.check(slot_holding(directory, 1), layout)["sequence"] == 1
    assert store.taken == (1 if store.writer else 0)
    info = store.restore()
    assert info.position is None and state.holds(1)
    store.close()


def test_a_lost_hosts_directory_leaves_the_others_copy(world, root, hosts):
    if len(set(hosts)) < 2:
        pytest.skip("one simulated host at 1 rank")
    state = State(world)
    store = make_store(state, new_job(world), root, world)
    state.set(1)
    store.take((KIND, 1))
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(os.path.join(store.job_directory, "host0"))
    world.Barrier()
    state.set(9)
    info = store.restore()
    assert info is not None and info.sequence == 1 and state.holds(1)
    assert os.path.dirname(info.path) == os.path.join(store.job_directory, "host1")
    assert same_everywhere(world, (summary(info), state.digest()))
    if world.rank == 0:
        shutil.rmtree(os.path.join(store.job_directory, "host1"))
    world.Barrier()
    state.set(9)
    assert store.restore() is None and state.holds(9)
    store.close()


def test_the_newest_snapshot_any_host_holds_wins(world, root, hosts):
    if len(set(hosts)) < 2:
        pytest.skip("one simulated host at 1 rank")
    state, store = two_snapshots(world, root)
    world.Barrier()
    host0, host1 = (os.path.join(store.job_directory, h) for h in ("host0", "host1"))
    if world.rank == 0:  # host0's newest is lost: it holds snapshot 1, host1 snapshot 2
        os.unlink(slot_holding(host0, 2))
    world.Barrier()
    state.set(9)
    info = store.restore()
    assert info.sequence == 2 and state.holds(2)  # on host0's ranks too: host1's values
    assert os.path.dirname(info.path) == host1
    assert same_everywhere(world, (summary(info), state.digest()))
    if world.rank == 0:  # and now host1 holds none newer than host0's
        for name in os.listdir(host1):
            if name.endswith(".data"):
                os.unlink(os.path.join(host1, name))
    world.Barrier()
    state.set(9)
    info = store.restore()
    assert info.sequence == 1 and state.holds(1)
    assert os.path.dirname(info.path) == host0
    assert same_everywhere(world, (summary(info), state.digest()))
    store.close()


# --- what an attacker (or an accident) leaves in the directory ----------------------------


def test_the_files_are_authenticated_as_the_tests_assume(world, root):
    state = State(world)
    store = make_store(state, new_job(world), root, world)
    state.set(1)
    store.take((KIND, 1))
    world.Barrier()
    layout = read_json(store.layout_path)
    assert layout["mac"] == layout_mac(SECRET, layout)
    assert layout_mac(b"another secret", layout) != layout["mac"]
    magic, sequence, length, mac, body = header_of(slot_holding(store.directory, 1))
    assert (magic, sequence) == (b"MPSNAP01", 1)
    assert mac == record_mac(SECRET, layout, 1, body)
    assert json.loads(body)["sequence"] == 1
    store.close()


class Target:
    """What an attack gets: the file, the host's layout (parsed), a directory outside."""

    def __init__(self, path, layout_path, elsewhere):
        self.path, self.layout_path, self.elsewhere = path, layout_path, elsewhere
        self.layout = read_json(layout_path)


def relayout(change, secret=SECRET, remac=True):
    """Edit the layout; re-authenticated under ``secret``, or keeping the old mac."""
    def attack(t):
        layout = dict(t.layout)
        change(layout)
        if remac:
            layout["mac"] = layout_mac(secret, layout)
        replace_file(t.path, json.dumps(layout, sort_keys=True).encode())
    return attack


def entry(target, **fields):
    def change(layout):
        layout["entries"] = [dict(e) for e in layout["entries"]]
        found = next(e for e in layout["entries"] if e["name"] == target)
        for key, value in fields.items():
            found[key] = value(found, layout) if callable(value) else value
    return change


def put(**fields):
    def change(mapping):
        mapping.update(fields)
    return change


def text(data):
    def attack(t):
        replace_file(t.path, data if isinstance(data, bytes) else data.encode())
    return attack


def symlinked(t):
    """The file replaced by a link to a valid copy of itself elsewhere."""
    planted = os.path.join(t.elsewhere, os.path.basename(t.path))
    shutil.copyfile(t.path, planted)
    os.unlink(t.path)
    os.symlink(planted, t.path)


def fifo(t):
    os.unlink(t.path)
    os.mkfifo(t.path, 0o600)


def directory(t):
    os.unlink(t.path)
    os.mkdir(t.path, 0o700)


def padded(size):
    def attack(t):
        with open(t.path) as file:
            content = file.read()
        replace_file(t.path, (content + " " * (size - len(content))).encode())
    return attack


def recommit(change=None, secret=SECRET, header_sequence=None, raw=None):
    """A new commit record in the slot, authenticated under ``secret``."""
    def attack(t):
        body = header_of(t.path)[4]
        record = json.loads(body)
        if change is not None:
            change(record)
        data = raw if raw is not None else json.dumps(record).encode()
        commit(t.path, t.layout, record.get("sequence", 2) if isinstance(record, dict)
               else 2, data, secret, header_sequence)
    return attack


def poke(offset, value: bytes):
    """Overwrite bytes of the slot's head in place (the old mac kept)."""
    def attack(t):
        with open(t.path, "r+b") as file:
            file.seek(offset)
            file.write(value)
    return attack


def flip_value(t):
    place = next(e for e in t.layout["entries"] if e["name"] == "w")
    with open(t.path, "r+b") as file:
        file.seek(place["offset"] + 5)
        byte = file.read(1)
        file.seek(place["offset"] + 5)
        file.write(bytes([byte[0] ^ 0x01]))


def flip_record(t):
    length = header_of(t.path)[2]
    with open(t.path, "r+b") as file:
        file.seek(HEADER.size + length - 2)
        byte = file.read(1)
        file.seek(HEADER.size + length - 2)
        file.write(bytes([byte[0] ^ 0x01]))


def truncated(t):
    os.truncate(t.path, os.path.getsize(t.path) // 2)


def mac_zeroed(t):
    with open(t.path, "r+b") as file:
        file.seek(HEADER.size - 32)
        file.write(bytes(32))


def header_zeroed(t):
    with open(t.path, "r+b") as file:
        file.write(HEADER.pack(b"MPSNAP01", 0, 0, bytes(32)))


DEEP = 100_000

NOT_THIS_JOBS = "not written by this job"
LAYOUT_ATTACKS = {
    # forged: the authentication fails
    "another secret": (relayout(lambda m: None, secret=b"not the job's secret"),
                       NOT_THIS_JOBS),
    "no mac": (relayout(lambda m: m.pop("mac"), remac=False), NOT_THIS_JOBS),
    "edited size, old mac": (relayout(put(size=1 << 40), remac=False), NOT_THIS_JOBS),
    "edited shape, old mac": (relayout(entry("w", shape=[4, 3]), remac=False),
                              NOT_THIS_JOBS),
    "edited offset, old mac": (relayout(entry("w", offset=lambda e, m: m["size"]),
                                        remac=False), NOT_THIS_JOBS),
    "edited nbytes, old mac": (relayout(entry("w", nbytes=lambda e, m: e["nbytes"] * 2),
                                        remac=False), NOT_THIS_JOBS),
    # authenticated (the job's secret), but not this job's or not these objects
    "another job's id": (relayout(lambda m: m.update(job=uuid.uuid4().hex)),
                         f"not a version {snapshot_module.VERSION} snapshot layout of job"),
    "another version": (relayout(put(version=snapshot_module.VERSION - 1)),
                        f"not a version {snapshot_module.VERSION} snapshot layout of job"),
    "header too small": (relayout(put(header=8)), "header 8 / size"),
    "size below the header": (relayout(lambda m: m.update(size=m["header"] - 1)),
                              "are not a layout's"),
    "header not a number": (relayout(put(header="4096")), "are not a layout's"),
    "offset beyond the size": (relayout(entry("w", offset=lambda e, m: m["size"])),
                               "entry 'w' has a bad place"),
    "offset in the header": (relayout(entry("model/v", offset=0)),
                             "entry 'model/v' has a bad place"),
    "overlapping values": (relayout(entry("w", offset=lambda e, m: next(
        x["offset"] for x in m["entries"] if x["name"] == "model/v"))),
        "entry 'w' has a bad place"),
    "float offset": (relayout(entry("w", offset=lambda e, m: float(e["offset"]))),
                     "entry 'w' has a bad place"),
    "nbytes": (relayout(entry("w", nbytes=lambda e, m: e["nbytes"] + 4)),
               "entry 'w' has a bad place"),
    "shape": (relayout(entry("w", shape=[4, 3])), r"entry 'w' is 'float32' \[4, 3\]"),
    "dtype": (relayout(entry("w", dtype="float64")), r"entry 'w' is 'float64'"),
    "other names": (relayout(entry("w", name="u")), "an entry is"),
    "other kind": (relayout(entry("w", kind="generator")), "an entry is"),
    "fewer entries": (relayout(lambda m: m.update(entries=m["entries"][:-1])),
                      "it holds 3 entries, the checkpoint 4 objects"),
    "entries not a list": (relayout(put(entries="all")), r"it holds \? entries"),
    "entry not an object": (relayout(lambda m: m.update(entries=[7, *m["entries"][1:]])),
                            "an entry is 7"),
    # not a layout at all
    "a symlink": (symlinked, "Too many levels of symbolic links"),
    "5 MiB": (padded(5 << 20), r"\d+ bytes, more than a \w+'s 4194304"),
    "not JSON": (text("{\"size\": 1, "), "not JSON"),
    "empty": (text(""), "not JSON"),
    "binary": (text(b"\x00\xff\xfegarbage"), "not JSON"),
    "JSON array": (text("[1, 2, 3]"), "not a JSON object"),
    "JSON string": (text("\"layout\""), "not a JSON object"),
    "FIFO": (fifo, "not a regular file"),
    "directory": (directory, "not a regular file"),
}


def _outcome_everywhere(world, store):
    info, error = outcome(store.restore)
    assert same_everywhere(world, (summary(info), repr(error)))
    assert error is None, f"{type(error).__name__}: {error}"
    return info


@pytest.mark.parametrize("attack", list(LAYOUT_ATTACKS))
def test_an_attacked_layout_is_skipped_with_its_reason(world, root, hosts, attack):
    """host0's layout is attacked: with a second host, its snapshot is restored and host0's
    reason reported; on one host there is nothing to restore. And check_layout() names
    the failed check."""
    change, reason = LAYOUT_ATTACKS[attack]
    state, store = two_snapshots(world, root)
    world.Barrier()
    host0 = os.path.join(store.job_directory, "host0", "layout.json")
    if world.rank == 0:
        elsewhere = tempfile.mkdtemp(dir=root)
        change(Target(host0, host0, elsewhere))
    world.Barrier()
    with pytest.raises((ValueError, OSError)) as raised:
        store.check_layout(host0)
    assert re.search(reason, str(raised.value)), (reason, str(raised.value))
    state.set(9)
    info = _outcome_everywhere(world, store)
    if len(set(hosts)) == 1:
        assert info is None and state.holds(9)
    else:
        assert info is not None and info.sequence == 2 and state.holds(2)
        assert os.path.dirname(info.path) == os.path.join(store.job_directory, "host1")
        assert len(info.skipped) == 1 and info.skipped[0].startswith(host0 + ": ")
        assert re.search(reason, info.skipped[0]), (reason, info.skipped)
    assert same_everywhere(world, state.digest())
    store.close()


SLOT_ATTACKS = {
    # torn or forged: the commit's authentication fails
    "never committed": (header_zeroed, "no committed snapshot"),
    "killed before the last write": (mac_zeroed, "not committed by this job"),
    "another magic": (poke(0, b"MPSNAP99"), "no committed snapshot"),
    "sequence edited, old mac": (poke(8, (7).to_bytes(8, "little")),
                                 "not committed by this job"),
    "record edited, old mac": (flip_record, "not committed by this job"),
    "record length edited, old mac": (poke(16, (5).to_bytes(8, "little")),
                                      "not committed by this job"),
    "record longer than its room": (poke(16, (1 << 40).to_bytes(8, "little")),
                                    r"its record is 1099511627776 bytes, more than"),
    "another secret": (recommit(secret=b"not the job's secret"), "not committed by this job"),
    # authenticated under the job's secret, but inconsistent
    "record's sequence not the header's": (recommit(header_sequence=5),
                                           "its record is not the one committed"),
    "record not JSON": (recommit(raw=b"{\"sequence\": 2,"), "its record is not JSON"),
    "record an array": (recommit(raw=b"[2]"), "its record is not the one committed"),
    "negative world size": (recommit(put(world_size=-1)), "world_size is -1"),
    "save counter true": (recommit(put(save_counter=True)), "save_counter is True"),
    "bad position": (recommit(put(position=[KIND, -1])), "position is"),
    "position not a pair": (recommit(put(position=KIND)), "position is"),
    "no generator": (recommit(put(generators={})),
                     "generator 'rng' has None, expected a generator's state"),
    "a state its generator refuses": (
        recommit(put(generators={"rng": {"bit_generator": "MT19937"}})),
        "generator 'rng' has .*, expected a state MT19937 accepts"),
    "another generator's state": (
        recommit(put(generators={"rng": json.loads(json.dumps(
            np.random.SFC64(5).state, default=lambda o: o.tolist()))})),
        "generator 'rng' holds a SFC64 state, the object is a PCG64"),
    "a forged legacy state": (
        recommit(put(generators={"rng": {"bit_generator": "RandomState", "key": "AAAA",
                                         "pos": 0, "has_gauss": 0, "gauss": 0.0}})),
        "generator 'rng' has 'AAAA', expected the base64 of 624 32-bit words"),
    "checksums missing": (recommit(lambda r: r["checksums"].pop()),
                          r"its checksums are not the \d+ of its values"),
    "checksum negative": (recommit(lambda r: r["checksums"].__setitem__(0, -1)),
                          r"its checksums are not the \d+ of its values"),
    "no parts": (recommit(lambda r: r.pop("parts")), "parts is None, expected 1 to 64"),
    "parts out of range": (recommit(put(parts=65)), "parts is 65, expected 1 to 64"),
    "parts not the copy's": (recommit(put(parts=2)),
                             r"its checksums are not the \d+ of its values"),
    "state parts not the parts": (recommit(put(state_parts=3)),
                                  r"state_parts is 3, expected 1 or its parts \(1\)"),
    "state parts true": (recommit(put(state_parts=True)), "state_parts is True"),
    # the values
    "flipped bit": (flip_value, "entries .*'w', checked together, do not match"),
    "truncated": (truncated, r"its data holds \d+ bytes"),
    # not a slot at all
    "a symlink": (symlinked, "Too many levels of symbolic links"),
    "FIFO": (fifo, "not a regular file"),
    "directory": (directory, "not a regular file"),
}


@pytest.mark.parametrize("attack", list(SLOT_ATTACKS))
def test_an_attacked_snapshot_is_skipped_and_the_older_one_restored(world, root, hosts,
                                                                   attack):
    """Snapshot 2 is attacked on every host: every rank skips it with its reason and
    restores snapshot 1."""
    change, reason = SLOT_ATTACKS[attack]
    state, store = two_snapshots(world, root)
    world.Barrier()
    attacked = world.bcast([slot_holding(d, 2) for d in host_dirs(store)]
                           if world.rank == 0 else None)  # (before rank 0 changes them)
    if world.rank == 0:
        for path in attacked:
            change(Target(path, os.path.join(os.path.dirname(path), "layout.json"),
                          tempfile.mkdtemp(dir=root)))
    world.Barrier()
    state.set(9)
    info = _outcome_everywhere(world, store)
    assert info is not None and info.sequence == 1 and info.position == (KIND, 1)
    assert header_of(info.path)[1] == 1 and state.holds(1)
    assert len(info.skipped) == len(set(hosts)), info.skipped
    for path, note in zip(attacked, sorted(info.skipped)):
        assert note.startswith(path + ": "), (path, note)
        assert re.search(reason, note), (reason, note)
    assert same_everywhere(world, state.digest())
    store.close()


def test_a_deleted_newest_slot_restores_the_previous_snapshot(world, root, hosts):
    state, store = two_snapshots(world, root)
    world.Barrier()
    if world.rank == 0:
        for d in host_dirs(store):
            os.unlink(slot_holding(d, 2))
    world.Barrier()
    state.set(9)
    info = _outcome_everywhere(world, store)
    assert info.sequence == 1 and state.holds(1) and info.skipped == ()
    store.close()


def test_records_are_bound_to_their_layout(world, root, hosts):
    """A layout re-authenticated with the job's secret but not the one the records were
    committed under (a field added): no record passes."""
    state, store = two_snapshots(world, root)
    world.Barrier()
    if world.rank == 0:
        for d in host_dirs(store):
            layout = os.path.join(d, "layout.json")
            relayout(put(comment="same places"))(Target(layout, layout, None))
    world.Barrier()
    state.set(9)
    info = _outcome_everywhere(world, store)
    assert info is None and state.holds(9)
    store.close()


def test_a_layout_larger_than_its_slots_skips_them(world, root, hosts):
    """A layout (authentic) whose size is beyond the slots' files: each slot is skipped,
    none is read past its end."""
    state = State(world)
    store = make_store(state, new_job(world), root, world)
    state.set(1)
    store.take((KIND, 1))
    world.Barrier()
    layout_path = os.path.join(host_dirs(store)[0], "layout.json")
    if world.rank == 0:
        relayout(put(size=1 << 40))(Target(layout_path, layout_path, None))
    world.Barrier()
    layout = store.check_layout(layout_path)
    with pytest.raises(ValueError, match=r"its data holds \d+ bytes"):
        store.check(slot_holding(os.path.dirname(layout_path), 1), layout)
    state.set(9)
    info = _outcome_everywhere(world, store)
    if len(set(hosts)) == 1:
        assert info is None and state.holds(9)
    else:
        assert info.sequence == 1 and state.holds(1) and len(info.skipped) == 1
    store.close()


def test_a_record_without_a_position_is_skipped_or_restored_whole(world, root):
    """An authentic record without its position field: a restore either skips it or
    restores it (no position) — never an error after the values were assigned."""
    state = State(world)
    store = make_store(state, new_job(world), root, world)
    state.set(1)
    store.take((KIND, 1))
    world.Barrier()
    if world.rank == 0:
        path = slot_holding(store.directory, 1)
        recommit(lambda r: r.pop("position"))(Target(path, store.layout_path, None))
    world.Barrier()
    state.set(9)
    info, error = outcome(store.restore)
    assert same_everywhere(world, (summary(info), repr(error), state.digest()))
    assert error is None, f"{type(error).__name__}: {error}"
    assert (info is None and state.holds(9)) or (info.position is None and state.holds(1))
    store.close()


def test_both_slots_attacked_is_none_and_changes_nothing(world, root, hosts):
    state, store = two_snapshots(world, root)
    world.Barrier()
    if world.rank == 0:
        for d in host_dirs(store):
            layout = os.path.join(d, "layout.json")
            flip_value(Target(slot_holding(d, 2), layout, None))
            mac_zeroed(Target(slot_holding(d, 1), layout, None))
    world.Barrier()
    state.set(9)
    info = _outcome_everywhere(world, store)
    assert info is None and state.holds(9) and state.checkpoint.save_counter == 0
    store.close()


def test_fifos_in_place_of_every_file_do_not_block(world, root):
    """Opening a FIFO for reading waits for a writer: the restore must not."""
    state = State(world, variable=False)
    store = make_store(state, new_job(world), root, world)
    state.set(1)
    store.take((KIND, 1))
    store.close()
    world.Barrier()
    if world.rank == 0:
        for name in ("slot-0.data", "slot-1.data"):
            path = os.path.join(store.directory, name)
            if os.path.exists(path):
                os.unlink(path)
            os.mkfifo(path, 0o600)
    world.Barrier()
    state.set(9)
    info = _outcome_everywhere(world, store)
    assert info is None and state.holds(9)
    world.Barrier()
    if world.rank == 0:
        os.unlink(store.layout_path)
        os.mkfifo(store.layout_path, 0o600)
    world.Barrier()
    info = _outcome_everywhere(world, store)
    assert info is None and state.holds(9)


def test_snapshots_of_other_objects_are_skipped(world, root, hosts):
    """Snapshots the same job took of another checkpoint (the script changed: another
    shape, other names, fewer objects) are never restored into this one."""
    job = new_job(world)
    other = Checkpoint(comm=world, w=np.ones((4, 3), np.float32), step=Scalar(7),
                       rng=np.random.default_rng(3), model={"v": np.ones((2, 3))})
    foreign = SnapshotStore(other, ElasticEnv(job, 0, (world.size,)), SECRET, comm=world,
                            root=root)
    foreign.take((KIND, 1))
    foreign.take((KIND, 2))
    foreign.close()
    state = State(world)
    state.set(9)
    renamed = Checkpoint(comm=world, u=np.zeros((4, 3), np.float32), step=Scalar(0),
                         rng=np.random.default_rng(1), model={"v": np.zeros((2, 3))})
    fewer = Checkpoint(comm=world, w=np.zeros((4, 3), np.float32), step=Scalar(0),
                       model={"v": np.zeros((2, 3))})
    for checkpoint, reason in (
            (state.checkpoint, "an entry is .*, expected variable 'model/v'"),
            (renamed, "an entry is .*, expected array 'u'"),
            (fewer, "it holds 4 entries, the checkpoint 3 objects")):
        store = SnapshotStore(checkpoint, ElasticEnv(job, 1, (world.size,)), SECRET,
                              comm=world, root=root)
        info = _outcome_everywhere(world, store)
        assert info is None
        with pytest.raises(ValueError, match=reason):
            store.check_layout(store.layout_path)
        store.close()
    assert state.holds(9)


def test_same_names_other_shapes_are_skipped(world, root):
    job = new_job(world)
    bigger = State(world)
    bigger.w = np.zeros((4, 4), np.float32)
    bigger.checkpoint = Checkpoint(comm=world, w=bigger.w, step=bigger.step, rng=bigger.rng,
                                   model={"v": bigger.v})
    foreign = make_store(bigger, job, root, world)
    foreign.take((KIND, 1))
    foreign.close()
    state = State(world)
    state.set(9)
    store = make_store(state, job, root, world, restart=1)
    assert _outcome_everywhere(world, store) is None and state.holds(9)
    with pytest.raises(ValueError, match=r"entry 'w' is 'float32' \[4, 4\], the object "
                                         r"float32 \[3, 4\]"):
        store.check_layout(store.layout_path)
    store.close()


# --- JSON nested past the parser's limit --------------------------------------------------


def _nested(depth):
    return "{\"mac\": \"0\", \"a\": " + "[" * depth + "]" * depth + "}"


def test_a_deeply_nested_layout_is_a_value_error(world, root):
    state = State(world, variable=False)
    store = make_store(state, new_job(world), root, world)
    path = os.path.join(root, f"deep-{world.rank}.json")
    try:
        for depth in (900, 990, 1000, 5000, DEEP):
            with open(path, "w") as file:
                file.write(_nested(depth))
            with pytest.raises(ValueError):
                store.check_layout(path)
    finally:
        store.close()


def test_a_deeply_nested_layout_is_skipped_on_every_rank(world, root, monkeypatch):
    """(Every rank its own host here, so that every rank is a writer and the bug, while
    it lasts, raises on every rank instead of hanging the others.)"""
    monkeypatch.setattr(socket, "gethostname", lambda: f"solo{world.rank}")
    state = State(world)
    store = make_store(state, new_job(world), root, world)
    state.set(1)
    store.take((KIND, 1))
    world.Barrier()
    if world.rank == 0:
        for d in host_dirs(store):
            replace_file(os.path.join(d, "layout.json"), _nested(DEEP).encode())
    world.Barrier()
    state.set(9)
    try:
        info = store.restore()
        assert info is None and state.holds(9)
    finally:
        store.close()


# --- the job directory --------------------------------------------------------------------


def _everyone_refuses(world, make):
    store, error = outcome(make)
    if store is not None:
        store.close()
    return world.allgather(None if error is None else (type(error).__name__, str(error)))


@pytest.mark.parametrize("how", ["symlink", "mode 0777", "host directory 0777", "a file"])
def test_an_unsafe_job_directory_is_refused_on_every_rank(world, root, how):
    job = new_job(world)
    state = State(world, variable=False)
    job_directory = os.path.join(root, f"mpistrat-elastic-{os.getuid()}-{job}")
    real = os.path.join(root, "real")
    if world.rank == 0:
        if how == "symlink":
            os.mkdir(real, 0o700)
            os.symlink(real, job_directory)
        elif how == "mode 0777":
            os.mkdir(job_directory)
            os.chmod(job_directory, 0o777)
        elif how == "host directory 0777":
            os.mkdir(job_directory, 0o700)
            host = os.path.join(job_directory, snapshot_module._HOST.sub(
                "_", socket.gethostname())[:64] or "host")
            os.mkdir(host)
            os.chmod(host, 0o777)
        else:
            open(job_directory, "w").close()
    world.Barrier()
    everyone = _everyone_refuses(world, lambda: make_store(state, job, root, world))
    for error in everyone:
        assert error is not None and error[0] == "PermissionError", everyone
        assert "not a private directory" in error[1] and "MPISTRAT_ELASTIC_DIR" in error[1]
    if how == "symlink":  # nothing was written through the link
        assert os.listdir(real) == []


def test_a_refused_directory_on_one_simulated_host_reaches_every_rank(world, root, hosts):
    if len(set(hosts)) < 2:
        pytest.skip("one simulated host at 1 rank")
    job = new_job(world)
    state = State(world, variable=False)
    if world.rank == 0:  # host1's directory only
        path = os.path.join(root, f"mpistrat-elastic-{os.getuid()}-{job}")
        os.mkdir(path, 0o700)
        os.mkdir(os.path.join(path, "host1"), 0o755)
    world.Barrier()
    everyone = _everyone_refuses(world, lambda: make_store(state, job, root, world))
    assert all(e is not None and e[0] == "PermissionError" and "host1" in e[1]
               for e in everyone), everyone


# --- torn writes --------------------------------------------------------------------------


class _NoChecksum:
    """Stands in for zlib in the snapshot module: the commit fails after the values were
    copied (as a rank killed there would leave its slot)."""

    @staticmethod
    def crc32(*args):
        raise OSError("killed before the commit")


def test_a_take_cut_short_leaves_the_previous_snapshot(world, root, hosts, monkeypatch):
    state, store = two_snapshots(world, root)
    state.set(3)
    monkeypatch.setattr(snapshot_module, "zlib", _NoChecksum)
    if store.writer:
        with pytest.warns(RuntimeWarning, match="snapshot 3 could not be written"):
            store.take((KIND, 3))
            store.wait()
    else:
        store.take((KIND, 3))
    monkeypatch.undo()
    monkeypatch.setattr(socket, "gethostname", lambda: hosts[world.rank])
    world.Barrier()
    for d in host_dirs(store):  # snapshot 1's slot now holds snapshot 3's values, uncommitted
        assert sequences_in(d) == [0, 2]
    state.set(9)
    info = _outcome_everywhere(world, store)
    assert info.sequence == 2 and info.position == (KIND, 2) and state.holds(2)
    assert len(info.skipped) == len(set(hosts))
    assert all("no committed snapshot" in note for note in info.skipped), info.skipped
    assert store.sequence == 2
    store.close()


# --- the checkpoint manager ---------------------------------------------------------------


@pytest.fixture
def elastic_job(world, root, monkeypatch):
    """This process as a rank of an elastic job's first launch (its snapshots in root)."""
    job = new_job(world)
    monkeypatch.setenv("MPISTRAT_ELASTIC", job)
    monkeypatch.setenv("MPISTRAT_ELASTIC_RESTART", "0")
    monkeypatch.setenv("MPISTRAT_ELASTIC_SIZES", str(world.size))
    monkeypatch.setenv("MPISTRAT_ELASTIC_LOST", "")
    monkeypatch.setenv("MPISTRAT_ELASTIC_SNAPSHOT_EVERY", "1")
    monkeypatch.setenv("MPISTRAT_ELASTIC_DIR", root)
    set_job_secret(SECRET)
    managers = []
    yield job, managers
    for manager in managers:
        if manager._snapshots is not None:
            manager._snapshots.close()


def local_ids(strategy, batch):
    return [np.asarray(x).tolist() for x in strategy.experimental_local_results(batch)]


def test_the_manager_restores_the_snapshot_and_the_input_position(world, root, elastic_job,
                                                                  monkeypatch):
    job, managers = elastic_job
    strategy = ms.MultiWorkerMirroredStrategy(comm=world)
    batch = 2 * world.size
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    dataset = Dataset.range(6 * batch).batch(batch).with_options(options)
    w, step = np.zeros(3, np.float32), Scalar(0)
    manager = CheckpointManager(Checkpoint(comm=world, w=w, step=step),
                                os.path.join(root, "ckpt"))
    managers.append(manager)
    assert hooks.taker() == manager._at_boundary
    dist = strategy.experimental_distribute_dataset(dataset)
    seen = []
    iterator = iter(dist)
    for i in range(3):
        seen.append(local_ids(strategy, next(iterator)))  # a snapshot of i steps' state
        w[...] = i + 1  # "train" on batch i
        step.assign(i + 1)
    seen.append(local_ids(strategy, next(iterator)))  # a snapshot of 3 steps', then lost
    store = manager._snapshots
    assert store is not None and store.sequence == 4
    assert store.taken == (4 if store.writer else 0)
    w[...] = -1
    step.assign(-1)

    # the relaunch: a new process (no taker), restart 1
    hooks.set_taker(None)
    monkeypatch.setenv("MPISTRAT_ELASTIC_RESTART", "1")
    w2, step2 = np.zeros(3, np.float32), Scalar(0)
    manager2 = CheckpointManager(Checkpoint(comm=world, w=w2, step=step2),
                                 os.path.join(root, "ckpt"))
    managers.append(manager2)
    path = manager2.restore_or_initialize()
    info = manager2.restored_snapshot
    assert info is not None and path == info.path
    assert os.path.dirname(path) == store.directory and header_of(path)[1] == 4
    assert info.sequence == 4 and info.position == (dist._kind(), 3) \
        and info.world_size == world.size
    np.testing.assert_array_equal(w2, np.full(3, 3, np.float32))
    assert int(step2) == 3
    dist2 = strategy.experimental_distribute_dataset(dataset)
    resumed = [local_ids(strategy, b) for b in dist2]
    assert len(resumed) == 3 and resumed[0] == seen[3]  # batches 3, 4, 5
    # a snapshot before each of them, numbered by its boundary (the first one the
    # restored boundary again)
    assert manager2._snapshots.sequence == 6
    again = [local_ids(strategy, b) for b in dist2]  # the next epoch starts at batch 0
    assert len(again) == 6 and again[:4] == seen
    assert same_everywhere(world, (summary(info), w2.tobytes(), int(step2)))


def test_an_evaluation_cut_short_resumes_after_its_epochs_training(world, root, elastic_job,
                                                                     monkeypatch):
    """An epoch: a training pass, then an evaluation pass over another distributed
    dataset, then the epoch counter. Lost in the evaluation: the relaunch (epoch counter
    still at the epoch) must not train on the epoch again, the evaluation resumes where
    it was, and the next epoch's evaluation runs whole."""
    job, managers = elastic_job
    strategy = ms.MultiWorkerMirroredStrategy(comm=world)
    batch = 2 * world.size
    options = Options()
    options.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA

    def train(epoch):
        return strategy.experimental_distribute_dataset(
            Dataset.range(4 * batch).shuffle(4 * batch, seed=epoch).batch(batch)
            .with_options(options))

    evaluation = strategy.experimental_distribute_dataset(
        Dataset.range(3 * batch).batch(batch).with_options(options))
    steps, epoch = Scalar(0), Scalar(0)
    manager = CheckpointManager(Checkpoint(comm=world, steps=steps, epoch=epoch),
                                os.path.join(root, "ckpt"))
    managers.append(manager)
    for _ in train(0):
        steps.assign_add(1)
    it = iter(evaluation)
    next(it), next(it)  # the second evaluation batch's boundary: the snapshot; then lost

    hooks.set_taker(None)
    monkeypatch.setenv("MPISTRAT_ELASTIC_RESTART", "1")
    steps2, epoch2 = Scalar(0), Scalar(0)
    manager2 = CheckpointManager(Checkpoint(comm=world, steps=steps2, epoch=epoch2),
                                 os.path.join(root, "ckpt"))
    managers.append(manager2)
    manager2.restore_or_initialize()
    info = manager2.restored_snapshot
    assert info is not None and info.position == (evaluation._kind(), 1)
    assert info.finished == ((train(0)._kind(), 4),)
    assert (int(steps2), int(epoch2)) == (4, 0)
    counts = []
    for e in range(int(epoch2), 2):  # the script's loop, from the restored epoch
        for _ in train(e):
            steps2.assign_add(1)
        counts.append(sum(1 for _ in evaluation))
        epoch2.assign(e + 1)
    assert int(steps2) == 8  # epoch 0's training not again, epoch 1's whole
    assert counts == [2, 3]  # epoch 0's evaluation from its second batch, epoch 1's whole
    assert same_everywhere(world, (int(steps2), counts))


def test_restart_zero_ignores_snapshots_and_a_restart_without_any_falls_back(
        world, root, elastic_job, monkeypatch):
    job, managers = elastic_job
    w = np.zeros(2, np.float32)
    manager = CheckpointManager(Checkpoint(comm=world, w=w), os.path.join(root, "ckpt"))
    managers.append(manager)
    w[...] = 5
    elastic.step()  # a boundary the script marks: a snapshot of w = 5
    w[...] = 7
    assert manager.restore_or_initialize() is None  # launch 0: nothing restored, no disk
    assert manager.restored_snapshot is None
    np.testing.assert_array_equal(w, np.full(2, 7, np.float32))
    hooks.set_taker(None)
    monkeypatch.setenv("MPISTRAT_ELASTIC_RESTART", "1")
    monkeypatch.setenv("MPISTRAT_ELASTIC", new_job(world))  # another job: no snapshot
    manager2 = CheckpointManager(Checkpoint(comm=world, w=w), os.path.join(root, "ckpt"))
    managers.append(manager2)
    assert manager2.restore_or_initialize() is None and manager2.restored_snapshot is None
    np.testing.assert_array_equal(w, np.full(2, 7, np.float32))


def test_snapshot_every_k_boundaries(world, root, elastic_job, monkeypatch):
    job, managers = elastic_job
    monkeypatch.setenv("MPISTRAT_ELASTIC_SNAPSHOT_EVERY", "3")
    step = Scalar(0)
    manager = CheckpointManager(Checkpoint(comm=world, step=step), os.path.join(root, "c"))
    managers.append(manager)
    for i in range(7):
        step.assign(i)
        hooks.step_boundary(("X/7", i))
    assert manager._snapshots.taken == (2 if manager._snapshots.writer else 0)
    assert manager._snapshots.sequence == 6  # boundaries 3 and 6
    hooks.set_taker(None)
    monkeypatch.setenv("MPISTRAT_ELASTIC_RESTART", "1")
    step2 = Scalar(0)
    manager2 = CheckpointManager(Checkpoint(comm=world, step=step2), os.path.join(root, "c"))
    managers.append(manager2)
    assert manager2.restore_or_initialize() is not None
    assert manager2.restored_snapshot.position == ("X/7", 5) and int(step2) == 5
    assert hooks.take_resume("X/7") == 5


def test_no_job_secret_means_no_snapshots(world, root, elastic_job):
    set_job_secret(None)
    with pytest.warns(RuntimeWarning, match="no job secret"):
        manager = CheckpointManager(Checkpoint(comm=world, w=np.zeros(1)),
                                    os.path.join(root, "c"))
    assert hooks.taker() is None and manager._snapshots is None


# --- a large state, copied by the host's ranks side by side -------------------------------


def shared_state(world):
    """A state the host's ranks share (at least SHARE_BYTES): a variable copied in the
    background, an array copied in take(), of odd sizes (the shares cut inside values)."""
    strategy = ms.MultiWorkerMirroredStrategy(comm=world)
    n = _shares.SHARE_BYTES // 8 + 1027
    with strategy.scope():
        big = ms.Variable(np.zeros(n, np.float32))
    table = np.zeros(_shares.SHARE_BYTES // 16 + 3, np.float64)

    def set_to(k):
        big.assign(np.arange(n, dtype=np.float32) * k)
        table[:] = np.arange(table.size) / k

    def holds(k):
        return (np.array_equal(np.asarray(big.numpy()), np.arange(n, dtype=np.float32) * k)
                and np.array_equal(table, np.arange(table.size) / k))

    return Checkpoint(comm=world, big=big, table=table), set_to, holds


def sharers(hosts, rank):
    return min(hosts.count(hosts[rank]), _shares.MAX_SHARERS)


@pytest.mark.parametrize("background", [True, False])
@pytest.mark.parametrize("simulated", [True, False], ids=["two hosts", "one host"])
def test_a_hosts_ranks_share_the_copy_of_a_large_state(world, root, request, background,
                                                       simulated):
    """Every rank of a host copies a share: the record says how many, each sharer counts
    the snapshot, and a restore after a few brings the newest back on every rank."""
    hosts = request.getfixturevalue("hosts") if simulated else \
        [socket.gethostname()] * world.size
    checkpoint, set_to, holds = shared_state(world)
    store = SnapshotStore(checkpoint, ElasticEnv(new_job(world), 0, (world.size,)), SECRET,
                          comm=world, root=root, background=background)
    assert store.collective == any(hosts.count(h) > 1 for h in hosts)
    for k in (1, 2, 3):
        set_to(k)
        store.take((KIND, k))
    store.wait()
    assert store.taken == (3 if store.writer or sharers(hosts, world.rank) > 1 else 0)
    world.Barrier()
    for directory in host_dirs(store):
        host = os.path.basename(directory)
        assert os.path.exists(os.path.join(directory, "shares.board")) == \
            (hosts.count(host) > 1), os.listdir(directory)
        layout = store.check_layout(os.path.join(directory, "layout.json"))
        record = store.check(slot_holding(directory, 3), layout)
        assert record["parts"] == hosts.count(host)
    set_to(9)
    info = _outcome_everywhere(world, store)
    assert info.sequence == 3 and holds(3) and info.skipped == ()
    # the next snapshot goes to the other slot on every sharer: the restored one stays
    set_to(4)
    store.take((KIND, 4))
    store.wait()
    world.Barrier()
    for directory in host_dirs(store):
        assert sorted(header_of(os.path.join(directory, f"slot-{i}.data"))[1]
                      for i in (0, 1)) == [3, 4]
    set_to(9)
    assert _outcome_everywhere(world, store).sequence == 4 and holds(4)
    store.close()


def test_a_bit_flipped_in_the_last_share_is_found(world, root, hosts):
    """A bit flipped, after the commit, in the last byte of the state (the last sharer's
    share): every rank skips that snapshot, naming the value and the share, and restores
    the one before."""
    checkpoint, set_to, holds = shared_state(world)
    store = SnapshotStore(checkpoint, ElasticEnv(new_job(world), 0, (world.size,)), SECRET,
                          comm=world, root=root)
    for k in (1, 2):
        set_to(k)
        store.take((KIND, k))
    flip_last_byte(world, store, "table", 2)
    set_to(9)
    info = _outcome_everywhere(world, store)
    assert info.sequence == 1 and holds(1)
    last = {h: sharers(hosts, hosts.index(h)) - 1 for h in set(hosts)}
    for note in info.skipped:
        host = os.path.basename(os.path.dirname(note.split(": ")[0]))
        share = f", share {last[host]})" if last[host] else ""
        assert "entry 'table' does not match its checksum" in note and \
            (share in note if share else "share" not in note), note
    assert len(info.skipped) == len(set(hosts))
    store.close()


def _never_posts(store, monkeypatch):
    monkeypatch.setattr(store._board, "post", lambda *args: None)


def _shm_full(store, monkeypatch):
    def full(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(store, "_mapped", full)


# how a sharer fails: (sabotage, the writer's wait, its warning, the sharer's, seconds)
SHARE_FAILURES = {
    "never posted": (_never_posts, 0.3, "share 1 of snapshot 2 was not copied within 0.3 s",
                     None, 10),
    "cannot be written": (_shm_full, 30.0,
                          "share 1 of snapshot 2 could not be copied on its rank",
                          "No space left on device", 10),
}


@pytest.mark.parametrize("how", list(SHARE_FAILURES))
def test_a_share_that_fails_leaves_the_previous_snapshot(world, root, hosts, monkeypatch,
                                                         how):
    """A sharer whose checksums never reach the board (killed, or not taking the
    snapshot: its writer gives up after the wait), or whose slot cannot be mapped
    (/dev/shm full: it warns and says so on the board, and its writer gives up at once,
    not after the 30 s wait): the writer warns and leaves the slot uncommitted; the
    snapshot before is restored on every rank."""
    if all(hosts.count(h) == 1 for h in hosts):
        pytest.skip("one rank a host: nothing is shared")
    sabotage, wait, writer_says, sharer_says, bound = SHARE_FAILURES[how]
    monkeypatch.setattr(_shares, "WAIT_S", wait)
    checkpoint, set_to, holds = shared_state(world)
    store = SnapshotStore(checkpoint, ElasticEnv(new_job(world), 0, (world.size,)), SECRET,
                          comm=world, root=root, background=False)
    set_to(1)
    store.take((KIND, 1))
    set_to(2)
    if store._part > 0:
        sabotage(store, monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        started = time.monotonic()
        store.take((KIND, 2))
        took = time.monotonic() - started
    messages = [str(w.message) for w in caught]
    if store.writer and hosts.count(hosts[world.rank]) > 1:
        assert any("snapshot 2 could not be written" in m and writer_says in m
                   for m in messages), messages
        assert took < bound, took
    elif store._part > 0 and sharer_says is not None:
        assert any(sharer_says in m for m in messages), messages
    else:
        assert messages == []
    world.Barrier()
    set_to(9)
    info = _outcome_everywhere(world, store)
    shared_hosts = {h for h in hosts if hosts.count(h) > 1}
    assert info.sequence == (1 if len(shared_hosts) == len(set(hosts)) else 2)
    assert holds(info.sequence)
    assert len(info.skipped) == len(shared_hosts)
    assert all("no committed snapshot" in note for note in info.skipped), info.skipped
    store.close()


def test_a_sharer_running_ahead_waits_for_the_writers_commit(world, root):
    """Snapshots taken with no collective between them (the sharers run ahead of their
    writer, which here sleeps before each take): each sharer waits until the writer has
    committed the snapshot it last wrote into a slot before writing that slot again, so
    every snapshot commits and the newest is restored."""
    checkpoint, set_to, holds = shared_state(world)
    store = SnapshotStore(checkpoint, ElasticEnv(new_job(world), 0, (world.size,)), SECRET,
                          comm=world, root=root, background=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(1, 6):
            set_to(k)
            if store.writer:
                time.sleep(0.05)
            store.take((KIND, k))
    assert [str(w.message) for w in caught] == []
    set_to(9)
    info = _outcome_everywhere(world, store)
    assert info.sequence == 5 and holds(5) and info.skipped == ()
    store.close()


def test_a_relaunch_on_fewer_ranks_keeps_the_layout_and_the_snapshots_before(world, root,
                                                                            monkeypatch):
    """A state shared by every rank of the host, then a relaunch on the lower half of
    them: its first snapshot is cut short before its commit, and the one the whole job
    took is still restored (the layout does not depend on how many ranks share)."""
    job = new_job(world)
    arrays = {f"a{i}": np.full(1 << 14, float(i)) for i in range(33)}  # (4.1 MiB)
    store = SnapshotStore(Checkpoint(comm=world, **arrays), ElasticEnv(job, 0, (world.size,)),
                          SECRET, comm=world, root=root)
    store.take((KIND, 1))
    store.close()
    half = world.Split(color=int(world.rank >= (world.size + 1) // 2), key=world.rank)
    try:
        if world.rank < (world.size + 1) // 2:
            mine = {name: np.zeros_like(a) for name, a in arrays.items()}
            smaller = SnapshotStore(Checkpoint(comm=half, **mine),
                                    ElasticEnv(job, 1, (world.size, half.size)), SECRET,
                                    comm=half, root=root)
            assert smaller.restore().sequence == 1
            for name, a in mine.items():
                a += 1
            if smaller.writer:  # (killed before its commit)
                monkeypatch.setattr(smaller, "_commit", lambda *args: None)
            smaller.take((KIND, 2))
            smaller.close()
            again = SnapshotStore(Checkpoint(comm=half, **mine),
                                  ElasticEnv(job, 2, (world.size, half.size, half.size)),
                                  SECRET, comm=half, root=root)
            info = again.restore()
            assert info is not None and info.sequence == 1, info
            assert all(np.array_equal(mine[n], arrays[n]) for n in arrays)
            again.close()
    finally:
        half.Free()
