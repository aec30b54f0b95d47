"""Elastic parameter-server jobs (``mpistrat run -n N --num-ps P --min-ranks M``): the
coordinator's snapshots, and their partner copy on another host.

Under MPI a lost worker or ps ends the whole launch, and ``mpistrat run`` launches the
script again on the ranks left (:mod:`mpistrat.runner.elastic`): rank 0 coordinates
again, ranks ``1..P`` are the ps again (with fresh, empty variables), and there is one
worker fewer (or more fewer, for a lost host). What carries the training over is the
coordinator's :class:`~mpistrat.CheckpointManager`: its checkpoint is over ``COMM_SELF``
and its leaves are the ps variables (and whatever else the script puts in it), so its
snapshots fetch the variables from the ps, and after the relaunch
``restore_or_initialize()`` assigns them to the new ps.

**Step boundaries on the coordinator**: every ``ClusterCoordinator.schedule()`` call
(before the new function is sent), ``join()`` (once every function has finished), and
``mpistrat.elastic.step()``. When a snapshot is due at one (``--snapshot-every``), the
coordinator first waits for every function scheduled so far (an error of one is raised
there, as by ``join()``, and no snapshot is taken): the snapshot holds the updates of
exactly the functions scheduled before it, each applied once. Between snapshots the
workers run asynchronously as always; a snapshot costs one drain of the workers.

**What the script must hold** so that a relaunch resumes exactly: a counter of the
functions whose updates the variables hold, in its checkpoint, from which its loop
resumes; the simplest is a ps variable that every scheduled function increments::

    with strategy.scope():
        w = ms.Variable(...)
        steps = ms.Variable(np.int64(0))          # each function adds 1
    manager = ms.CheckpointManager(ms.Checkpoint(w=w, steps=steps), "ckpt")
    manager.restore_or_initialize()               # a relaunch: the snapshot's values
    for i in range(int(steps.numpy()), STEPS):    # the functions after it, again
        coordinator.schedule(train_step, args=(batches, i))
    coordinator.join()

(an ``ms.Scalar`` the coordinator increments after each ``schedule()`` returns works
too.) Functions scheduled after the snapshot, which ran or not when the launch was lost,
are scheduled again by that loop, on the workers left: a lost worker's functions rerun
elsewhere. ``RemoteValue``s of the lost launch are gone; per-worker datasets start
afresh on every worker (their position is not in the snapshot: draw batches at random,
or from the function's index, for an exact replay).

**The partner copy**: the coordinator's snapshot is on its own host only; when the job
spans hosts, the coordinator also sends every snapshot it takes (its layout and the
committed slot, bytes as they are: the same format and HMAC) to its *partner*, the
lowest rank on another host than rank 0's, which writes them into that host's directory
of the job. A relaunch after the loss of rank 0's host starts its rank 0 on the first
host left, which is the partner's: its ``restore_or_initialize()`` finds the copy there.
(One copy: losing both hosts at once falls back to the checkpoint on disk.) The partner
receives in a thread that polls every :data:`POLL_S` seconds while its rank serves, and
deletes its copy when the job ends well.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from .._atomic import write_atomically
from ..checkpoint.snapshot import DIR_ENV, SnapshotStore
from ..elastic.env import ElasticEnv

__all__ = ["partner_of", "job_directory", "host_directory", "PartnerReceiver",
           "send_snapshot", "SNAPSHOT_TAG", "POLL_S"]

SNAPSHOT_TAG = 4041
POLL_S = 0.01
_SLOTS = ("slot-0.data", "slot-1.data")
_SEQUENCE = struct.Struct("<8sQ")  # a slot's magic and sequence (snapshot.py's header)
_MAGIC = b"MPSNAP01"


def partner_of(hosts: Sequence[str], coordinator: int = 0) -> int | None:
    """The rank that keeps the coordinator's partner copy: the lowest on another host
    than the coordinator's (``hosts``: each rank's); None when every rank shares it."""
    for rank, host in enumerate(hosts):
        if host != hosts[coordinator]:
            return rank
    return None


def job_directory(launch: ElasticEnv) -> str:
    """The job's snapshot directory, as :class:`SnapshotStore` names it."""
    root = os.environ.get(DIR_ENV) or (
        "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    return os.path.join(root, f"mpistrat-elastic-{os.getuid()}-{launch.job}")


def host_directory(launch: ElasticEnv, host: str | None = None) -> str:
    """This host's directory in :func:`job_directory` (as :class:`SnapshotStore`'s)."""
    from ..checkpoint.snapshot import _HOST

    host = socket.gethostname() if host is None else host
    return os.path.join(job_directory(launch), _HOST.sub("_", host)[:64] or "host")


def _newest_slot(store: SnapshotStore) -> str | None:
    """The store's slot file that holds its newest snapshot, once committed."""
    store.wait()
    for name in _SLOTS:
        path = os.path.join(store.directory, name)
        try:
            with open(path, "rb") as file:
                magic, sequence = _SEQUENCE.unpack(file.read(_SEQUENCE.size))
        except (OSError, struct.error):
            continue
        if magic == _MAGIC and sequence == store.sequence:
            return path
    return None


def send_snapshot(store: SnapshotStore, comm: Any, partner: int) -> bool:
    """Send the store's newest snapshot (its layout and committed slot, as bytes) to
    ``partner`` of ``comm``; False when there is none to send (its commit failed)."""
    if not store.writer:
        return False
    path = _newest_slot(store)
    if path is None:
        return False
    with open(store.layout_path, "rb") as file:
        layout = file.read()
    with open(path, "rb") as file:
        data = file.read()
    comm.send(("snapshot", layout, os.path.basename(path), data), dest=partner,
              tag=SNAPSHOT_TAG)
    return True


class PartnerReceiver:
    """The partner's side: a thread that writes the coordinator's snapshots into this
    host's directory of the job, until the coordinator says the job has ended (then the
    copy is deleted).

    Args:
        comm: the job's communicator (the coordinator sends on it, tag
            :data:`SNAPSHOT_TAG`).
        coordinator: the coordinator's rank in it.
        launch: the job's launch (its id names the directory).
    """

    def __init__(self, comm: Any, coordinator: int, launch: ElasticEnv) -> None:
        self._comm = comm
        self._coordinator = coordinator
        self.directory = host_directory(launch)
        self.job_directory = job_directory(launch)
        self.received = 0
        self.error: str | None = None
        self._layout: bytes | None = None
        self._thread = threading.Thread(target=self._run, name="mpistrat-partner-copy",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        comm, source = self._comm, self._coordinator
        while True:
            while not comm.Iprobe(source=source, tag=SNAPSHOT_TAG):
                time.sleep(POLL_S)
            message = comm.recv(source=source, tag=SNAPSHOT_TAG)
            if message is None:  # the job has ended well: its snapshots go
                shutil.rmtree(self.directory, ignore_errors=True)
                try:
                    os.rmdir(self.job_directory)
                except OSError:
                    pass
                return
            try:
                self._write(message)
            except Exception as exc:  # noqa: BLE001 - training goes on without the copy
                self.error = f"{type(exc).__name__}: {exc}"

    def _write(self, message: Any) -> None:
        from ..checkpoint.snapshot import _private_directory

        kind, layout, name, data = message
        if kind != "snapshot" or name not in _SLOTS or not isinstance(layout, bytes) or \
                not isinstance(data, bytes):
            raise ValueError(f"not a snapshot: {kind!r}, {name!r}")
        _private_directory(self.job_directory)
        _private_directory(self.directory)
        # (the slot is authenticated with its layout: an old slot under a new layout,
        # or the reverse, fails the restore's check and is skipped)
        if layout != self._layout:
            write_atomically(os.path.join(self.directory, "layout.json"), layout,
                             mode=0o600)
            self._layout = layout
        write_atomically(os.path.join(self.directory, name), data, mode=0o600)
        os.utime(self.job_directory)  # (a live job's snapshots are never swept)
        self.received += 1

    def join(self) -> None:
        """Until the coordinator's end message has been handled."""
        self._thread.join()
