"""``ZeroRedundancyOptimizer``: each rank of a node steps its share of the parameters,
which the node's ranks hold in one shared copy.

With :class:`mpistrat.torch.DistributedDataParallel` every rank ends backward with the
same reduced gradients, and an ordinary optimizer then makes every rank do the same
update of its own copy of every parameter: the same memory traffic once per rank, all
ranks at the same moment. Here the parameters live in memory the ranks of a node
share (:func:`mpistrat.runtime.shared.node_empty`), and the parameters are split among
those ranks: each rank keeps the optimizer state of its share only and updates only its
share, in place, for everyone on the node; a barrier of the node's ranks ends the step.
Nodes hold a copy each and update it alike, from the same gradients with the same
arithmetic, so every rank sees the same bits. This is ZeRO's first stage (Rajbhandari
et al. 2020; ``torch.distributed.optim.ZeroRedundancyOptimizer``) without the
all-gather of the updated parameters, which shared memory makes unnecessary.

Design:

* Construction is collective over ``comm``: every rank passes the same parameters (in
  the same order, shapes and dtypes), optimizer class and options (checked; a mismatch
  raises on every rank). The parameters' storage moves into node-shared memory then
  (``param.data`` is replaced; the values stay), one block per dtype.
* The shares are whole parameters, largest first to the rank with the fewest elements
  so far (ties to the lower rank), the same on every node.
* ``param_groups`` is the global view (every parameter, as an ordinary optimizer has
  it), so learning-rate schedulers work; each step copies the groups' settings to the
  rank's own optimizer, which holds the groups it has parameters of.
* ``state_dict()`` is the state of an ordinary optimizer over all the parameters, after
  :meth:`ZeroRedundancyOptimizer.consolidate_state_dict` has gathered it on one rank (as
  torch's); ``load_state_dict`` takes such a state on every rank, so checkpoints move
  between this optimizer and an ordinary one.

Under :mod:`mpistrat.trace` each step is a span ``ZeRO step`` (``user_annotation``): this
rank's share of the update, then the node's barrier, a collective ``ZeRO barrier`` whose
``agreement`` is the time this rank waited for the node's slowest share (there is no
broadcast or all-gather of parameters to record: the node's ranks share them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..runtime import recorder
from ..runtime._mpi import Comm, mpi, world
from ..runtime.agreement import agree, close_door, open_door
from ..runtime.shared import node_empty
from ..runtime.topology import get_topology

__all__ = ["ZeroRedundancyOptimizer"]

_ALIGN = 64  # bytes: every parameter starts on a cache line of its own


def _groups(params: Any) -> list[dict[str, Any]]:
    """``params`` as an optimizer takes them (tensors, or dicts of options with a
    ``"params"`` entry) as a list of groups with a list of tensors each."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or of parameter groups "
                        "(dicts), as for any torch optimizer, not a single tensor")
    items = list(params)
    if not items:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list")
    if all(isinstance(item, dict) for item in items):
        groups = []
        for item in items:
            group = dict(item)
            members = group.get("params")
            group["params"] = [members] if isinstance(members, torch.Tensor) \
                else list(members or ())
            groups.append(group)
    elif any(isinstance(item, dict) for item in items):
        raise TypeError("params mixes tensors and parameter groups (dicts); pass one kind")
    else:
        groups = [{"params": items}]
    for group in groups:
        for p in group["params"]:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params holds a {type(p).__name__}: expected tensors (a "
                                f"module's parameters) or parameter groups of them")
            if not p.is_leaf or not p.requires_grad:
                raise TypeError("params holds a tensor that is not a leaf requiring grad: "
                                "pass the trainable parameters (model.parameters())")
            if p.device.type != "cpu":
                raise ValueError(f"a parameter is on {p.device}: ZeroRedundancyOptimizer "
                                 f"shares CPU memory; keep the module on the CPU")
    return groups


def _shares(sizes: list[int], ranks: int) -> list[int]:
    """The owner (node rank) of every parameter: largest first, to the least loaded rank
    (ties: the lower rank)."""
    load = [0] * ranks
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += sizes[i]
    return owner


class ZeroRedundancyOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer_class`` so that each rank of a node steps its share of the
    parameters, in memory the node's ranks share.

    Collective over ``comm`` (default ``COMM_WORLD``): every rank constructs it with the
    same parameters and options, after :class:`~mpistrat.torch.DistributedDataParallel`
    (whose gradients, the same on every rank, it steps with). Use it as any optimizer:
    ``zero_grad()``, ``step()``, learning-rate schedulers, ``state_dict()`` after
    :meth:`consolidate_state_dict`.

    Args:
        params: the parameters (tensors or parameter groups), as for ``optimizer_class``.
        optimizer_class: a ``torch.optim.Optimizer`` subclass (``torch.optim.SGD``,
            ``torch.optim.AdamW``, ...).
        comm: the ranks that train together (as given to DistributedDataParallel).
        **defaults: ``optimizer_class``'s options (``lr=0.1, momentum=0.9``).

    Raises:
        TypeError, ValueError: bad arguments, or ranks that passed different ones
            (:class:`~mpistrat.CollectiveMismatchError`), on every rank.
    """

    def __init__(self, params: Any, optimizer_class: type[torch.optim.Optimizer], *,
                 comm: Comm | None = None, **defaults: Any) -> None:
        self.comm = world() if comm is None else comm
        error: BaseException | None = None
        signature = None
        groups: list[dict[str, Any]] = []
        try:
            if not (isinstance(optimizer_class, type)
                    and issubclass(optimizer_class, torch.optim.Optimizer)):
                raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass "
                                f"such as torch.optim.SGD, got {optimizer_class!r}")
            groups = _groups(params)
            seen: set[int] = set()
            for group in groups:
                for p in group["params"]:
                    if id(p) in seen:
                        raise ValueError("a parameter appears more than once in params")
                    seen.add(id(p))
            signature = (f"{optimizer_class.__module__}.{optimizer_class.__qualname__} "
                         f"{sorted(defaults.items())!r} " + " | ".join(
                             f"{sorted((k, v) for k, v in g.items() if k != 'params')!r}: "
                             + ";".join(f"{tuple(p.shape)}:{p.dtype}" for p in g["params"])
                             for g in groups))
        except (TypeError, ValueError) as exc:
            error = exc
        agree(self.comm, signature, error, "ZeroRedundancyOptimizer",
              "the same parameters, optimizer class and options")
        node = get_topology(self.comm).node_comm
        self._node = node
        self._all = [p for g in groups for p in g["params"]]
        self._share_memory(node)
        self._pointers = [p.data_ptr() for p in self._all]
        owner = _shares([p.numel() for p in self._all], node.Get_size())
        owned = {id(p) for p, o in zip(self._all, owner) if o == node.Get_rank()}
        # this rank's optimizer: the groups it has parameters of, and where they sit
        local = [{**{k: v for k, v in g.items() if k != "params"},
                  "params": [p for p in g["params"] if id(p) in owned]}
                 for g in groups]
        self._local_of = [i for i, g in enumerate(local) if g["params"]]
        self.optim: torch.optim.Optimizer | None = \
            optimizer_class([local[i] for i in self._local_of], **defaults) \
            if self._local_of else None
        # the class's defaults filled in (a rank that owns nothing asks a throwaway one)
        filled = (self.optim or optimizer_class([torch.zeros(1, requires_grad=True)],
                                                **defaults)).defaults
        super().__init__(groups, filled)
        self._ready = True
        self._consolidated_on: int | None = None

    # --- memory ------------------------------------------------------------------------

    def _share_memory(self, node: Comm) -> None:
        """Move every parameter into node-shared memory (one block per dtype), values
        from the node's first rank (every rank holds the same after DistributedDataParallel's
        broadcast)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._all:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            members = by_dtype[dtype]
            align = max(1, _ALIGN // members[0].element_size())  # elements per 64 bytes
            starts, at = [], 0
            for p in members:  # each parameter on a cache line of its own
                starts.append(at)
                at += -(-p.numel() // align) * align
            memory = node_empty(max(1, at) * members[0].element_size(), "uint8", self.comm)
            flat = torch.from_numpy(memory).view(dtype)
            views = [flat[start:start + p.numel()].view(p.shape)
                     for start, p in zip(starts, members)]
            if node.Get_rank() == 0:
                with torch.no_grad():
                    for view, p in zip(views, members):
                        view.copy_(p)
            node.Barrier()
            for view, p in zip(views, members):
                p.data = view

    # --- the optimizer -------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_ready", False):
            raise ValueError("ZeroRedundancyOptimizer takes its parameter groups at "
                             "construction (they are split among the ranks then); create "
                             "it with every group")
        super().add_param_group(param_group)

    def _sync_settings(self) -> None:
        """The global groups' settings (lr, ... a scheduler may have changed) onto this
        rank's optimizer."""
        if self.optim is None:
            return
        for group, index in zip(self.optim.param_groups, self._local_of):
            for key, value in self.param_groups[index].items():
                if key != "params":
                    group[key] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step this rank's share (the parameters' gradients must be the reduced ones),
        then wait for the node's other ranks: when it returns, every parameter is
        updated. Collective over the node's ranks; an error on one of them (its step
        failed, or a parameter's storage was replaced since construction) raises on
        all. ``closure``, if given, is called (with gradients enabled) on every rank
        first, as for any optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = recorder.begin()
        error: BaseException | None = None
        try:
            moved = [i for i, (p, at) in enumerate(zip(self._all, self._pointers))
                     if p.data_ptr() != at]
            if moved:
                raise RuntimeError(
                    f"the storage of parameter(s) {moved[:5]} was replaced after the "
                    f"ZeroRedundancyOptimizer was made (module.to(), .double(), "
                    f"param.data = ...): the node's ranks no longer share them, so each "
                    f"would update only its own share; make the optimizer after such "
                    f"changes")
            self._sync_settings()
            if self.optim is not None:
                self.optim.step()
        except Exception as exc:  # raised on every rank of the node by the agreement
            error = exc
        try:
            self._barrier(error)
        finally:
            if t:
                recorder.end(t, "ZeRO step", recorder.USER,
                             {"parameters": sum(len(g["params"]) for g in
                                                self.optim.param_groups) if self.optim
                              else 0, "node ranks": self._node.Get_size()})
        if self._consolidated_on is not None:  # the gathered state is stale now
            self.state.clear()
            self._consolidated_on = None
        return loss

    def _barrier(self, error: BaseException | None) -> None:
        """The end of a step: the node's ranks agree that every share was stepped (a
        barrier; traced, a collective ``barrier`` on the node's communicator)."""
        start = open_door(self._node) if recorder.on else 0
        try:
            agree(self._node, None if error is not None else "step", error,
                  "ZeroRedundancyOptimizer.step", "a step")
        finally:
            if start:
                close_door(start, "ZeRO barrier", "barrier", self._node.Get_size(), "", 0,
                           0, 0, "agreement")

    # --- state ---------------------------------------------------------------------------

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole optimizer state on rank ``to`` of ``comm`` (from the ranks of
        its node, which hold it between them), so that :meth:`state_dict` works there.
        Collective over ``comm``: every rank passes the same ``to`` (checked)."""
        MPI = mpi()
        error: BaseException | None = None
        if isinstance(to, bool) or not isinstance(to, int) \
                or not 0 <= to < self.comm.Get_size():
            error = ValueError(f"to must be a rank of the communicator (0 to "
                               f"{self.comm.Get_size() - 1}), got {to!r}")
        agree(self.comm, None if error is not None else f"to={to}", error,
              "consolidate_state_dict", "the same rank to gather on")
        world_group, node_group = self.comm.Get_group(), self._node.Get_group()
        try:
            here = MPI.Group.Translate_ranks(world_group, [to], node_group)[0] \
                != MPI.UNDEFINED
        finally:
            world_group.Free()
            node_group.Free()
        index = {id(p): i for i, p in enumerate(self._all)}
        mine = None
        if here and self.optim is not None:
            mine = {index[id(p)]: state for p, state in self.optim.state.items()}
        gathered = self.comm.gather(mine, root=to)
        self.state.clear()
        if self.comm.Get_rank() == to:
            for part in gathered or ():
                for i, state in (part or {}).items():
                    self.state[self._all[i]] = state
            self._consolidated_on = to

    @property
    def shard_comm(self) -> Comm:
        """The ranks that hold the optimizer state between them: this rank's node's (each
        node holds it whole)."""
        return self._node

    def shard_state(self) -> tuple[dict[int, Any], dict[str, Any]]:
        """This rank's share of :meth:`state_dict`, without gathering anything: the state
        of each parameter this rank steps, keyed by the parameter's number in
        ``state_dict()`` (its place among every group's parameters), and the state_dict's
        other entries (``param_groups``, the same on every rank). The shares of the
        ranks of :attr:`shard_comm` together are ``state_dict()["state"]``: an elastic
        job's snapshot copies each rank's share side by side
        (:mod:`mpistrat.checkpoint.snapshot`), and ``load_state_dict`` takes them joined."""
        number = {id(p): i for i, p in enumerate(self._all)}
        mine = {number[id(p)]: state for p, state in self.optim.state.items()} \
            if self.optim is not None else {}
        rest = {key: value for key, value in torch.optim.Optimizer.state_dict(self).items()
                if key != "state"}
        return mine, rest

    def shard_params(self) -> int:
        """How many parameters this rank steps (whose state :meth:`shard_state` holds)."""
        return sum(len(g["params"]) for g in self.optim.param_groups) \
            if self.optim is not None else 0

    def state_dict(self) -> dict[str, Any]:
        """The state of an ordinary ``optimizer_class`` over all the parameters, on the
        rank that :meth:`consolidate_state_dict` gathered it on.

        Raises:
            RuntimeError: the state was not consolidated on this rank since the last step.
        """
        if self._consolidated_on != self.comm.Get_rank():
            raise RuntimeError("call consolidate_state_dict(to=RANK) on every rank first, "
                               "then state_dict() on rank RANK: each rank holds only its "
                               "share of the optimizer state")
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the state of an ordinary optimizer over the same parameters (or a
        consolidated one) on every rank; each keeps its share."""
        super().load_state_dict(state_dict)
        if self.optim is not None:
            self._sync_settings()
            self.optim.state.clear()
            for p in (p for g in self.optim.param_groups for p in g["params"]):
                if p in self.state:
                    self.optim.state[p] = self.state[p]
        self.state.clear()
        self._consolidated_on = None
