"""All-reduce algorithms: the names (:mod:`.registry`), what the code behind a name offers
(:class:`Implementation`) and the tensors an algorithm reads (:class:`Source`).

This package only names things. Each algorithm lives in its own module (``ring``,
``halving_doubling``, ``shuffle``, ``native``, ``shm``, ``nccl``; ``hierarchical`` for
``a/b``) as a function over a communicator and a contiguous 1-D buffer that it reduces
in place, ``f(comm, buf, *, op, shards, backend, rotation)``; see each module's docstring
for its steps, the bytes it moves and its preconditions. Where a name becomes that code,
and the checks that come first, is :mod:`mpistrat.dispatch`.
"""

from __future__ import annotations

from .implementation import Implementation
from .registry import AlgorithmInfo, Pool, Shards, get, names, register
from .source import Source, agreed_join

__all__ = [
    "AlgorithmInfo", "Shards", "Pool", "get", "names", "register", "Implementation",
    "Source", "agreed_join",
]
