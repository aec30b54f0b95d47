"""Communication options of the cross-device ops (``tf.distribute.experimental.CommunicationOptions``)."""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = ["CommunicationImplementation", "CollectiveCommunication", "CommunicationOptions",
           "CollectiveHints"]


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to use: AUTO (NCCL when every rank has GPUs and NCCL
    works, else the ring), RING (mpistrat's ``xring`` over MPI) or NCCL."""

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"

    @classmethod
    def parse(cls, value: Any) -> CommunicationImplementation:
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.strip().upper() in cls.__members__:
            return cls[value.strip().upper()]
        raise ValueError(
            f"implementation must be one of {', '.join(cls.__members__)} (a "
            f"CommunicationImplementation or its name), got {value!r}"
        )


# TF's older name for the same enum.
CollectiveCommunication = CommunicationImplementation


@dataclass(frozen=True)
class CommunicationOptions:
    """Options for ``reduce`` and ``batch_reduce``.

    Attributes:
        bytes_per_pack: > 0 packs a batch into packs of about this many bytes (TF's
            ``pack_by_size``); 0 leaves packing to the cross-device op's own settings.
        timeout_seconds: how long a collective may wait for the other ranks; past it,
            every waiting rank raises :class:`~mpistrat.errors.CollectiveTimeoutError`
            naming the ranks that did not arrive. None waits forever.
        implementation: RING, NCCL or AUTO.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        if isinstance(self.bytes_per_pack, bool) or not isinstance(self.bytes_per_pack, int) \
                or self.bytes_per_pack < 0:
            raise ValueError(
                f"bytes_per_pack must be an integer >= 0 (0: no size-based packing), got "
                f"{self.bytes_per_pack!r}"
            )
        if self.timeout_seconds is not None and (
                isinstance(self.timeout_seconds, bool)
                or not isinstance(self.timeout_seconds, (int, float))
                or not self.timeout_seconds > 0):
            raise ValueError(
                f"timeout_seconds must be a number > 0 or None (no timeout), got "
                f"{self.timeout_seconds!r}"
            )
        object.__setattr__(self, "implementation",
                           CommunicationImplementation.parse(self.implementation))


def CollectiveHints(bytes_per_pack: int = 0,  # noqa: N802 (TF's name)
                    timeout_seconds: float | None = None) -> CommunicationOptions:
    """TF's ``tf.distribute.experimental.CollectiveHints``, deprecated there in favour of
    :class:`CommunicationOptions`: returns ``CommunicationOptions(bytes_per_pack,
    timeout_seconds)``, as TF's does, with a ``DeprecationWarning``."""
    warnings.warn("CollectiveHints is deprecated (as in TF): use "
                  "CommunicationOptions(bytes_per_pack=..., timeout_seconds=...)",
                  DeprecationWarning, stacklevel=2)
    return CommunicationOptions(bytes_per_pack=bytes_per_pack, timeout_seconds=timeout_seconds)
