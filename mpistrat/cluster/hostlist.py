"""Slurm's compressed list syntaxes, expanded: host lists and tasks-per-node lists.

* host list (``SLURM_JOB_NODELIST``): ``node[01-03,07],gpu-a[1-2]`` is
  ``node01 node02 node03 node07 gpu-a1 gpu-a2``. Ranges keep the zero padding of their
  first number; several bracket groups in one name expand as a product, first group
  outermost (``r[1-2]n[1-2]`` is ``r1n1 r1n2 r2n1 r2n2``). Order is kept, duplicates too.
* tasks per node (``SLURM_TASKS_PER_NODE``): ``2(x3),1`` is ``2 2 2 1``.

Pure functions of strings; a malformed value raises a ``TopologyError`` naming the
variable it came from.
"""

from __future__ import annotations

import itertools
import re

from ..errors import TopologyError

__all__ = ["expand_hostlist", "expand_tasks_per_node"]

_GROUP = re.compile(r"(\[[^\[\]]*\])")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_hostlist(hostlist: str, variable: str = "the host list") -> list[str]:
    """The host names of a Slurm host list, in order.

    Args:
        hostlist: e.g. ``"node[01-03,07],gpu-a[1-2]"``.
        variable: where the value came from, for messages (``"SLURM_JOB_NODELIST"``).

    Raises:
        TopologyError: unbalanced or nested brackets, an empty name or range, a bound
            that is not a number, or a range whose end is below its start.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist, variable):
        choices: list[list[str]] = []
        for token in _GROUP.split(item):
            if token.startswith("["):
                choices.append(_expand_ranges(token[1:-1], hostlist, variable))
            elif token:
                choices.append([token])
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def _split_top_level(text: str, variable: str) -> list[str]:
    items: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise _bad(variable, text, "nested '['")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise _bad(variable, text, "']' without '['")
        if char == "," and depth == 0:
            items.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if depth:
        raise _bad(variable, text, "'[' without ']'")
    items.append("".join(current).strip())
    if any(not item for item in items):
        raise _bad(variable, text, "an empty host name")
    return items


def _expand_ranges(ranges: str, text: str, variable: str) -> list[str]:
    names = []
    for part in ranges.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise _bad(variable, text, f"range {part!r} is not N or N-M")
        if not dash:
            names.append(low)
            continue
        if int(high) < int(low):
            raise _bad(variable, text, f"range {part!r} ends below its start")
        names.extend(f"{n:0{len(low)}d}" for n in range(int(low), int(high) + 1))
    return names


def _bad(variable: str, text: str, problem: str) -> TopologyError:
    return TopologyError(
        f"{variable}={text!r} is not a Slurm host list ({problem}); expected e.g. "
        f"'node[01-03,07],gpu-a[1-2]' (scontrol show hostnames expands it)"
    )


def expand_tasks_per_node(tasks_per_node: str, variable: str = "the tasks per node") -> list[int]:
    """The task count of each node, in node order: ``"2(x3),1"`` is ``[2, 2, 2, 1]``.

    Raises:
        TopologyError: an item that is not ``N`` or ``N(xK)``.
    """
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = _TASKS.fullmatch(item.strip())
        if match is None:
            raise TopologyError(
                f"{variable}={tasks_per_node!r} is not a Slurm tasks-per-node list (item "
                f"{item!r} is not N or N(xK)); expected e.g. '2(x3),1'"
            )
        count, repeat = match.groups()
        counts.extend([int(count)] * int(repeat or 1))
    return counts
