"""``InputContext``: what a ``dataset_fn`` passed to ``distribute_datasets_from_function``
knows about the input pipeline it builds (``tf.distribute.InputContext``)."""

from __future__ import annotations

from .rebatch import _count

__all__ = ["InputContext"]


class InputContext:
    """Describes one input pipeline among several.

    Args:
        num_input_pipelines: how many pipelines there are (workers in PER_WORKER mode,
            replicas in PER_REPLICA mode).
        input_pipeline_id: this pipeline's index in ``[0, num_input_pipelines)``; shard
            with ``dataset.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)``.
        num_replicas_in_sync: replicas across all workers that consume the pipelines.
    """

    __slots__ = ("_num_input_pipelines", "_input_pipeline_id", "_num_replicas_in_sync")

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1) -> None:
        pipelines = _count(num_input_pipelines, "num_input_pipelines", 1)
        pipeline = _count(input_pipeline_id, "input_pipeline_id", 0)
        if pipeline >= pipelines:
            raise ValueError(f"input_pipeline_id must be in [0, {pipelines - 1}] for "
                             f"num_input_pipelines={pipelines}, got {pipeline}")
        self._num_input_pipelines = pipelines
        self._input_pipeline_id = pipeline
        self._num_replicas_in_sync = _count(num_replicas_in_sync, "num_replicas_in_sync", 1)

    @property
    def num_input_pipelines(self) -> int:
        """The number of input pipelines."""
        return self._num_input_pipelines

    @property
    def input_pipeline_id(self) -> int:
        """This pipeline's index."""
        return self._input_pipeline_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas in sync (all workers)."""
        return self._num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size`` divided by ``num_replicas_in_sync``.

        Raises:
            ValueError: ``global_batch_size`` is not divisible by ``num_replicas_in_sync``.
        """
        size = _count(global_batch_size, "global_batch_size", 0)
        if size % self._num_replicas_in_sync:
            n = self._num_replicas_in_sync
            raise ValueError(
                f"The `global_batch_size` {global_batch_size!r} is not divisible by "
                f"`num_replicas_in_sync` {n!r}; use a multiple of {n}, e.g. "
                f"{(size // n + 1) * n}"
            )
        return size // self._num_replicas_in_sync

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InputContext):
            return NotImplemented
        return (self._num_input_pipelines, self._input_pipeline_id,
                self._num_replicas_in_sync) == (other._num_input_pipelines,
                                                other._input_pipeline_id,
                                                other._num_replicas_in_sync)

    def __hash__(self) -> int:
        return hash((self._num_input_pipelines, self._input_pipeline_id,
                     self._num_replicas_in_sync))

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self._num_input_pipelines}, "
                f"input_pipeline_id={self._input_pipeline_id}, "
                f"num_replicas_in_sync={self._num_replicas_in_sync})")
