"""PyTorch over MPI: ``import mpistrat.torch``.

Two ways to train a PyTorch model data-parallel with mpistrat (docs/torch.md):

* **torch's own ``torch.distributed``, unchanged**: importing this package registers the
  ``"mpistrat"`` backend, so ``dist.init_process_group("mpistrat")`` gives every
  collective of ``torch.distributed`` (and torch's ``DistributedDataParallel``,
  ``ZeroRedundancyOptimizer``, FSDP, ``torch.distributed.checkpoint`` on top) over MPI,
  with the rank and size from MPI: :mod:`mpistrat.torch.backend`.
* **mpistrat's own wrapper**, :class:`DistributedDataParallel` with gradient buckets in
  node-shared memory, and :class:`ZeroRedundancyOptimizer` stepping each rank's share of
  node-shared parameters: :mod:`mpistrat.torch.ddp`, :mod:`mpistrat.torch.zero`.

Elastic training (``mpistrat run --min-ranks``): a ``CheckpointManager`` over a
``Checkpoint(model=net, optimizer=opt, ...)`` snapshots the module's and the optimizer's
state (:mod:`mpistrat.checkpoint` takes torch tensors and objects with ``state_dict()``),
and :class:`DistributedBatchSampler` marks the step boundaries and resumes the input at
the same global batch on fewer ranks (with :class:`DataLoader`, torch's, telling it how
far worker processes load ahead): :mod:`mpistrat.torch.sampler`.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as _missing:  # torch is an optional extra
    raise ImportError(
        "mpistrat.torch needs PyTorch, which is not installed: "
        "pip install 'mpistrat[torch]' (the CPU build is enough)"
    ) from _missing

from .backend import BACKEND_NAME, ProcessGroupMPI, register, use_instead_of_gloo
from .ddp import (
    DEFAULT_BUCKET_BYTES,
    FUSED_BYTES,
    DistributedDataParallel,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .sampler import DataLoader, DistributedBatchSampler
from .zero import ZeroRedundancyOptimizer

__all__ = ["DistributedDataParallel", "ZeroRedundancyOptimizer", "DistributedBatchSampler",
           "DataLoader", "broadcast_parameters",
           "broadcast_optimizer_state", "DEFAULT_BUCKET_BYTES", "FUSED_BYTES",
           "BACKEND_NAME", "ProcessGroupMPI", "register", "use_instead_of_gloo"]

register()
