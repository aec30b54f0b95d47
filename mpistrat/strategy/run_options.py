"""``RunOptions``: TF's options for ``Strategy.run``.

All three fields steer how TF compiles the replica function for TPUs (XLA, padding of
dynamic shapes). Here the function runs as Python on every replica as it is, so the fields
are accepted, checked and otherwise change nothing: a script that passes
``options=RunOptions(...)`` runs unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["RunOptions", "check_run_options"]


class RunOptions(NamedTuple):
    """Options for :meth:`Strategy.run` (TF's ``tf.distribute.RunOptions``).

    Attributes:
        experimental_enable_dynamic_batch_size: TF on TPUs: recompile for each batch size
            (default True). Here every batch size runs as it comes; ignored.
        experimental_bucketizing_dynamic_shape: TF on TPUs: pad dynamic shapes to buckets
            (default False). Nothing is padded here; ignored.
        experimental_xla_options: TF's ``tf.tpu.XLAOptions`` for the TPU compiler (default
            None). Nothing is compiled here; ignored.
    """

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None


def check_run_options(options: Any, what: str = "run") -> RunOptions:
    """``options`` as a :class:`RunOptions` (None: the defaults).

    Raises:
        TypeError: ``options`` is something else (say ``CommunicationOptions``, which
            belong to ``reduce``/``all_reduce``), or a flag is not a bool.
    """
    if options is None:
        return RunOptions()
    if not isinstance(options, RunOptions):
        raise TypeError(
            f"{what}() options must be an mpistrat.RunOptions (TF's tf.distribute.RunOptions) "
            f"or None, got {type(options).__name__}; CommunicationOptions go to "
            f"strategy.reduce / replica_context.all_reduce instead"
        )
    for field in ("experimental_enable_dynamic_batch_size",
                  "experimental_bucketizing_dynamic_shape"):
        if not isinstance(getattr(options, field), bool):
            raise TypeError(f"RunOptions.{field} must be True or False, got "
                            f"{getattr(options, field)!r}")
    return options
