"""``TFConfigClusterResolver``: the cluster and task from the ``TF_CONFIG`` variable.

``TF_CONFIG`` is a JSON object, as in TensorFlow::

    {"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},
     "task": {"type": "worker", "index": 1},
     "rpc_layer": "grpc"}

``cluster`` maps job names to addresses; ``task`` says which of them this process is
(``type`` is turned into a string, so ``123`` is ``"123"``; ``index`` may be a string of
digits, ``"1"``); ``rpc_layer`` and ``session_master`` are optional. A missing (or
blank) ``TF_CONFIG`` means local mode: an empty cluster and no task.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import TopologyError
from .base import ClusterResolver, coerce_task_id
from .cluster_spec import ClusterSpec

__all__ = ["TF_CONFIG", "TFConfig", "parse_tf_config", "TFConfigClusterResolver"]

TF_CONFIG = "TF_CONFIG"

_EXAMPLE = (
    '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
    '"task": {"type": "worker", "index": 0}}'
)


@dataclass(frozen=True)
class TFConfig:
    """The parsed content of ``TF_CONFIG``.

    Attributes:
        cluster: the ``cluster`` entry (empty when absent: local mode).
        task_type: ``str(task["type"])``, or None.
        task_id: ``task["index"]`` as an int, or None.
        rpc_layer: the ``rpc_layer`` entry, or None.
        session_master: the ``session_master`` entry, or None.
    """

    cluster: ClusterSpec = field(default_factory=lambda: ClusterSpec({}))
    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = None
    session_master: str | None = None


def parse_tf_config(text: str | None) -> TFConfig:
    """Parse the value of ``TF_CONFIG`` (None or blank: local mode).

    Raises:
        TopologyError (a ValueError): the text is not a JSON object, or an entry has
            the wrong type; the message names ``TF_CONFIG``, the entry and the fix.
    """
    if text is None or not text.strip():
        return TFConfig()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TopologyError(
            f"{TF_CONFIG} is not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno}): {_clip(text)}; fix: set {TF_CONFIG} to a JSON object such as "
            f"'{_EXAMPLE}'"
        ) from None
    if not isinstance(config, dict):
        raise TopologyError(
            f"{TF_CONFIG} must be a JSON object, got a JSON {type(config).__name__}: "
            f"{_clip(text)}; fix: use an object such as '{_EXAMPLE}'"
        )
    cluster = _entry(config, "cluster", dict, {})
    try:
        spec = ClusterSpec(cluster)
    except TypeError as exc:
        raise TopologyError(
            f'{TF_CONFIG} has a bad "cluster": {exc}; fix: map each job name to a list '
            f'of "host:port" strings'
        ) from None
    task = _entry(config, "task", dict, {})
    task_type = None if task.get("type") is None else str(task["type"])
    try:
        task_id = coerce_task_id(task.get("index"), "task.index")
    except ValueError as exc:
        raise TopologyError(f"{TF_CONFIG}: {exc}; fix: use e.g. \"index\": 0") from None
    return TFConfig(
        cluster=spec,
        task_type=task_type,
        task_id=task_id,
        rpc_layer=_entry(config, "rpc_layer", str, None),
        session_master=_entry(config, "session_master", str, None),
    )


def _entry(config: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        expected = "a JSON object" if kind is dict else "a string"
        raise TopologyError(
            f'{TF_CONFIG}\'s "{key}" must be {expected}, got {json.dumps(value)}; fix: '
            f"see the example '{_EXAMPLE}'"
        )
    return value


def _clip(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class TFConfigClusterResolver(ClusterResolver):
    """The cluster, task and rpc layer described by ``TF_CONFIG``.

    Args:
        task_type, task_id: override the ``task`` of ``TF_CONFIG``.
        rpc_layer: override its ``rpc_layer``.
        environment: the value of :attr:`environment`.
        env: the environment to read ``TF_CONFIG`` from (default ``os.environ``),
            read once, here.

    Raises:
        ValueError: ``task_id`` is not a non-negative integer. A malformed
            ``TF_CONFIG`` is raised by the first method that needs it, not here.
    """

    source = TF_CONFIG

    def __init__(self, task_type: str | None = None, task_id: int | None = None,
                 rpc_layer: str | None = None, environment: str = "",
                 env: Mapping[str, str] | None = None) -> None:
        environ = os.environ if env is None else env
        self._config: TFConfig | None = None
        self._error: TopologyError | None = None
        try:
            self._config = parse_tf_config(environ.get(TF_CONFIG))
        except TopologyError as exc:
            self._error = exc
        if task_type is not None:
            self.task_type = task_type
        if task_id is not None:
            self.task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @property
    def config(self) -> TFConfig:
        """The parsed ``TF_CONFIG`` (raises its parse error, if it had one)."""
        if self._error is not None:
            raise self._error
        assert self._config is not None
        return self._config

    def cluster_spec(self) -> ClusterSpec:
        """``TF_CONFIG``'s cluster; empty when it has none (local mode)."""
        return self.config.cluster

    def _default_task_type(self) -> str | None:
        return self.config.task_type

    def _default_task_id(self) -> int | None:
        return self.config.task_id

    @property
    def rpc_layer(self) -> str | None:
        """The constructor's (or a set) rpc layer, else ``TF_CONFIG``'s, else None."""
        return self._rpc_layer if self._rpc_layer is not None else self.config.rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, value: str | None) -> None:
        self._rpc_layer = value

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The session master URL, by TF's rules.

        ``TF_CONFIG``'s ``session_master`` if it has one; ``""`` when the cluster has no
        job or a single job with a single task (nothing to connect to); otherwise the
        address of ``(task_type, task_id)`` (default: this task) with the rpc layer.
        """
        config = self.config
        if config.session_master is not None:
            return config.session_master
        spec = config.cluster
        if not spec or (len(spec.jobs) == 1 and spec.num_tasks(spec.jobs[0]) == 1):
            return ""
        return super().master(task_type, task_id, rpc_layer)
