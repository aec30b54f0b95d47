"""torchrun's variables for the script, so that an unmodified ``torch.distributed`` script
runs under ``mpistrat run`` as it does under ``torchrun`` (docs/run.md, "torch.distributed
scripts").

Before the script starts, every rank gets, in ``os.environ`` (a variable the user already
set is kept):

* ``RANK``, ``WORLD_SIZE`` — MPI's rank and size of ``COMM_WORLD`` (a user's value must
  agree: otherwise :class:`~mpistrat.errors.RunSetupError` on every rank);
* ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` — the rank among, and the number of, the ranks on
  this host (``Split_type(COMM_TYPE_SHARED)``: physical hosts, whatever
  ``MPISTRAT_RANKS_PER_NODE`` says, since scripts pick their GPU by ``LOCAL_RANK``);
* ``GROUP_RANK``, ``GROUP_WORLD_SIZE`` — this host's index (hosts ordered by their lowest
  rank) and the number of hosts;
* ``ROLE_RANK``, ``ROLE_WORLD_SIZE`` — as ``RANK`` and ``WORLD_SIZE`` (one role);
* ``MASTER_ADDR``, ``MASTER_PORT`` — where rank 0 serves torch's ``env://`` store: the
  loopback for a job on one host, else rank 0's address that the other hosts reach (that
  of the interface ``HYDRA_IFACE`` names, when rank 0's host has it; else one that the
  routes from rank 0 to every other host leave from; else rank 0's host name), and a TCP
  port free on rank 0's host; rank 0 picks both (its own ``MASTER_ADDR`` or
  ``MASTER_PORT``, when set, instead) and broadcasts them.

Nothing here imports torch (``mpistrat run`` must not pay its import unless asked):
:func:`use_mpistrat_backend` imports :mod:`mpistrat.torch` only for
``--torch-backend mpistrat``.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

from ..config import RUN_MASTER
from ..errors import RunSetupError
from ..runtime._mpi import mpi
from .hosts import interface_address, local_addresses, route_sources

__all__ = ["TORCH_ENV", "set_torch_env", "restore_env", "master_address",
           "free_port", "use_mpistrat_backend", "TORCH_EXTRA_HINT"]

TORCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TORCH_EXTRA_HINT = "pip install 'mpistrat[torch]' (the CPU build is enough)"
_CHECKED = ("RANK", "WORLD_SIZE")  # a user's value must be MPI's
_LOOPBACK = "127.0.0.1"
_SHOWN = 4  # ranks' problems named in one setup error


def _given(environ: Mapping[str, str], name: str) -> str | None:
    """The user's value of ``name`` (an empty one counts as unset)."""
    value = environ.get(name)
    return value if value is not None and value.strip() else None


def _disagreements(environ: Mapping[str, str], rank: int,
                   size: int) -> tuple[tuple[str, str], ...]:
    """The user's ``RANK``/``WORLD_SIZE`` on this rank that are not MPI's: (name, value)."""
    found = []
    for name, expected in zip(_CHECKED, (rank, size)):
        given = _given(environ, name)
        if given is None:
            continue
        try:
            agrees = int(given) == expected
        except ValueError:
            agrees = False
        if not agrees:
            found.append((name, given))
    return tuple(found)


def _mismatch_text(found: Sequence[tuple[tuple[str, str], ...]]) -> str | None:
    """The setup error's text for every rank's :func:`_disagreements` (rank order), or
    None when every rank agrees with MPI."""
    size = len(found)
    where: dict[tuple[str, str], list[int]] = {}
    for rank, pairs in enumerate(found):
        for pair in pairs:
            where.setdefault(pair, []).append(rank)
    if not where:
        return None
    parts = []
    for (name, given), ranks in list(where.items())[:_SHOWN]:
        listed = ", ".join(str(r) for r in ranks[:_SHOWN]) + \
            (f" and {len(ranks) - _SHOWN} more" if len(ranks) > _SHOWN else "")
        if name == "WORLD_SIZE":
            on = "every rank" if len(ranks) == size else f"MPI rank(s) {listed}"
            parts.append(f"WORLD_SIZE={given!r} is set in the environment of {on}, but MPI's "
                         f"world size is {size}")
        else:
            many = len(ranks) > 1
            parts.append(f"RANK={given!r} is set in the environment of the rank{'s' * many} "
                         f"MPI numbers {listed} (of {size})")
    return "; ".join(parts)


def set_torch_env(comm: Any = None, environ: MutableMapping[str, str] | None = None, *,
                  interface: str | None = None) -> dict[str, str | None]:
    """Set torchrun's variables (:data:`TORCH_ENV`) in ``environ`` where unset; collective
    over ``comm`` (default ``COMM_WORLD``).

    Args:
        comm: the job's communicator.
        environ: where to set them (default ``os.environ``).
        interface: the network interface rank 0's address is taken from across hosts
            (default ``HYDRA_IFACE``, hydra's own choice, when set).

    Returns:
        The previous value (None: unset) of every variable set, for :func:`restore_env`.

    Raises:
        RunSetupError: on every rank, when ``RANK`` or ``WORLD_SIZE`` is set on some rank
            and is not MPI's rank or size there (nothing is set then).
    """
    MPI = mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    environ = os.environ if environ is None else environ
    rank, size = comm.Get_rank(), comm.Get_size()
    if interface is None:
        interface = environ.get("HYDRA_IFACE") or None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    try:
        local_rank, local_size = node.Get_rank(), node.Get_size()
        leader = node.bcast(rank, root=0)
    finally:
        node.Free()
    seen = comm.allgather((leader, _disagreements(environ, rank, size),
                           _given(environ, "MASTER_ADDR") is not None))
    problem = _mismatch_text([pairs for _, pairs, _ in seen])
    if problem is not None:
        raise RunSetupError(
            f"mpistrat run: {problem}. mpistrat run sets RANK and WORLD_SIZE from MPI for "
            f"torch.distributed; unset them (or set MPI's values)")
    leaders = sorted({lead for lead, _, _ in seen})
    group = leaders.index(leader)
    # across hosts, rank 0 picks its address from the routes to the other hosts (one
    # rank of each tells its host's addresses), unless rank 0 has a MASTER_ADDR
    across = len(leaders) > 1 and not seen[0][2]
    found: list[list[str] | None] = []
    if across:
        found = comm.gather(local_addresses() if leader == rank and group != 0 else None,
                            root=0)
    master = None
    if rank == 0:
        addr = _given(environ, "MASTER_ADDR")
        if addr is None:
            addr = master_address([a for a in found if a is not None],
                                  interface=interface) if across else _LOOPBACK
        port = _given(environ, "MASTER_PORT") or str(free_port())
        master = (addr, port)
    addr, port = comm.bcast(master, root=0)
    values = {
        "RANK": str(rank), "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_size),
        "GROUP_RANK": str(group), "GROUP_WORLD_SIZE": str(len(leaders)),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(size),
        "MASTER_ADDR": addr, "MASTER_PORT": port,
    }
    saved: dict[str, str | None] = {}
    for name, value in values.items():
        if _given(environ, name) is None:
            saved[name] = environ.get(name)
            environ[name] = value
    if "MASTER_ADDR" in saved and "MASTER_PORT" in saved:
        # the address is mpistrat run's, not the user's: mpistrat.torch's rendezvous
        # then serves the store over MPI instead of a TCP port (docs/torch.md)
        saved[RUN_MASTER] = environ.get(RUN_MASTER)
        environ[RUN_MASTER] = f"{addr}:{port}"
    return saved


def restore_env(saved: Mapping[str, str | None],
                environ: MutableMapping[str, str] | None = None) -> None:
    """Undo :func:`set_torch_env` (``saved`` is what it returned)."""
    environ = os.environ if environ is None else environ
    for name, value in saved.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def master_address(remote: Sequence[Iterable[str]], *, interface: str | None = None,
                   ours: Iterable[str] | None = None,
                   routes: Callable[[Iterable[str]], list[str]] = route_sources,
                   hostname: Callable[[], str] = socket.gethostname) -> str:
    """This host's address that the hosts with addresses ``remote`` (one list per other
    host) reach it at: ``interface``'s when given and it has one; else one that the routes
    to every other host leave from (this host's own addresses among ``remote``, e.g. a
    ``docker0`` every host has, tell nothing and are skipped); else this host's name, for
    the other hosts to resolve."""
    if interface and (found := interface_address(interface)):
        return found
    own = set(local_addresses() if ours is None else ours)
    common: list[str] | None = None
    for addresses in remote:
        sources = routes([a for a in addresses if a not in own and not a.startswith("127.")])
        if not sources:
            continue  # (nothing known of that host; the others decide)
        common = sources if common is None else [a for a in common if a in sources]
    return common[0] if common else hostname()


def free_port(host: str = "") -> int:
    """A TCP port no socket of this host is bound to now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def use_mpistrat_backend(comm: Any = None) -> None:
    """``--torch-backend mpistrat``: import :mod:`mpistrat.torch` and make the script's
    gloo (and default-backend) process groups use the ``"mpistrat"`` backend
    (:func:`mpistrat.torch.use_instead_of_gloo`). Collective over ``comm`` (default
    ``COMM_WORLD``).

    Raises:
        RunSetupError: on every rank, when any rank cannot (PyTorch missing: the message
            names the fix).
    """
    comm = mpi().COMM_WORLD if comm is None else comm
    problem = None
    try:
        missing = importlib.util.find_spec("torch") is None
    except (ImportError, ValueError):
        missing = True
    if missing:
        problem = f"PyTorch is not installed: {TORCH_EXTRA_HINT}"
    else:
        try:
            import mpistrat.torch as adapter

            adapter.use_instead_of_gloo()
        except Exception as exc:  # noqa: BLE001 - reported on every rank
            problem = (f"import mpistrat.torch and use_instead_of_gloo() failed "
                       f"({type(exc).__name__}: {exc}); check the PyTorch installation "
                       f"({TORCH_EXTRA_HINT})")
    problems = comm.allgather(problem)
    bad = [r for r, text in enumerate(problems) if text is not None]
    if bad:
        where = "" if len(bad) == len(problems) else \
            f" (on rank(s) {bad} of {len(problems)})"
        raise RunSetupError(f"mpistrat run: --torch-backend mpistrat needs mpistrat.torch: "
                            f"{problems[bad[0]]}{where}")
