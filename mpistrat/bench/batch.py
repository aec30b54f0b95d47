"""``--batch``: a whole gradient batch through ``MultiWorkerAllReduce.batch_reduce``,
beside the MPI library's per-tensor and flat all-reduce.

The batch is a list of shapes (``resnet50``: ResNet-50 v1's 161 gradients, 97.5 MiB in
float32; or a JSON file), each tensor its own array, ``G`` of them per rank. Methods,
timed in the same run, round-robin with a rotating start:

* ``per-tensor native``: one ``MPI_Allreduce`` per tensor, in place (the reference
  result; it overwrites the gradients, which ``batch_reduce`` may not do);
* ``per-tensor native, out of place``: one ``MPI_Allreduce(x, out)`` per tensor into
  buffers kept from call to call, the inputs left alone: ``batch_reduce``'s contract
  (new results, inputs unchanged), for a like-for-like comparison — with ``G > 1`` the
  local sum already goes to the output, so it is the in-place row again;
* ``flat native``: one ``MPI_Allreduce`` of a flat buffer of the batch's total size;
* ``flat SPEC``: the spec's algorithm for that total size, called directly on the flat
  buffer (the all-reduce alone: no packing, no API);
* ``flat SPEC (batch_reduce)``: ``batch_reduce`` of that one flat tensor (adds the
  API's cost: checks, the agreement, one copy);
* ``batch_reduce num_packs=P`` per ``num_packs`` value, ``batch_reduce agg B/M`` (small
  tensors aggregated) and ``batch_reduce no packing`` (one all-reduce per tensor);
* ``batch_reduce num_packs=P, one buffer`` (the first ``P``): the same tensors kept as
  views of one flat array, in order, as a training loop can keep its gradients — in
  shared memory with ``--shared`` (:func:`mpistrat.shared_arrays`). A pack of such
  tensors is reduced as that one buffer.

With ``--compare torch`` (one replica per rank), torch.distributed on the same values,
held in torch tensors created once, over each peer's process group
(:class:`~.peers.TorchPeer`: ``torch-gloo``, and ``torch-mpistrat`` where the "mpistrat"
backend can be made), three rows each:

* ``torch-BACKEND per-tensor``: one ``all_reduce`` per tensor, in place (a hand-written
  loop over the gradients);
* ``torch-BACKEND all_reduce_coalesced``: one ``all_reduce_coalesced`` of the batch;
* ``torch-BACKEND flat (cat, split)``: ``torch.cat`` of the batch, one ``all_reduce``,
  the pieces copied back into the tensors.

Inputs are small integers (exact sums); in-place methods get their input back before
each iteration, outside the timed region; with G > 1 adding up the local replicas is
part of every method's timed work, as it is inside ``batch_reduce``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import dispatch
from ..backends import get_backend
from ..cross_device_ops import MultiWorkerAllReduce
from ..ops import ReduceOp
from ..packing import flat_arrays, plan_tf_packing
from ..runtime._mpi import Comm, mpi
from ..runtime.shared import shared_arrays
from ..spec import AllReduceSpec, format_bytes
from ..values import PerReplica, components_of
from .check import fill_pattern
from .config import BatchConfig
from .report import format_ratio
from .results import Point
from .shapes import resnet50_gradient_shapes

__all__ = ["load_shapes", "Method", "build_methods", "BatchBench", "batch_table"]


def load_shapes(source: str) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """The batch named by ``--batch``: ``resnet50``, or a JSON file holding a list of
    shapes (``[[64, 3, 7, 7], [64], ...]``) or ``{"shapes": [...]}``.

    Raises:
        ValueError: an unknown name, an unreadable file or malformed shapes.
    """
    if source.strip().lower() == "resnet50":
        return "resnet50", tuple(tuple(s) for s in resnet50_gradient_shapes())
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"--batch {source!r}: expected 'resnet50' or a JSON file of shapes "
                         f"(e.g. [[64, 3, 7, 7], [64]]), and no such file exists")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--batch {source!r}: cannot read it as JSON ({exc})") from None
    shapes = data.get("shapes") if isinstance(data, dict) else data
    if not isinstance(shapes, list) or not shapes:
        raise ValueError(f"--batch {source!r}: expected a non-empty list of shapes or "
                         f"{{\"shapes\": [...]}}, got {type(shapes).__name__}")
    out = []
    for i, shape in enumerate(shapes):
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                           for d in shape)):
            raise ValueError(f"--batch {source!r}: shape {i} is {shape!r}; expected a list "
                             f"of integers >= 0")
        out.append(tuple(shape))
    return path.name, tuple(out)


@dataclass
class Method:
    """One way of reducing the batch (a row of the table)."""

    label: str
    # per-tensor | per-tensor-oop | flat-native | flat-spec | flat-batch | batch |
    # batch-views | torch-each | torch-coalesced | torch-flat
    kind: str
    calls: int
    plan: str
    ops: Any = None
    num_packs: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "kind": self.kind, "calls": self.calls,
                "plan": self.plan, "num_packs": self.num_packs}


def _name(alg: str, shards: int) -> str:
    return alg if shards == 1 else f"{alg}#{shards}"


def _plan(spec: AllReduceSpec, shapes: Sequence[tuple[int, ...]], dtype: np.dtype,
          num_packs: int, agg_bytes: int, agg_group: int) -> tuple[int, str]:
    """What MultiWorkerAllReduce does with the batch: (all-reduce calls, description)."""
    specs = [(s, dtype) for s in shapes]
    routed: dict[int, list[int]] = {}
    for i, shape in enumerate(shapes):
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        routed.setdefault(spec.index_for(nbytes), []).append(i)
    calls, parts = 0, []
    for entry in sorted(routed):
        plan = plan_tf_packing([specs[i] for i in routed[entry]], num_packs=num_packs,
                               agg_small_grads_max_bytes=agg_bytes,
                               agg_small_grads_max_group=agg_group if agg_bytes else 0)
        calls += len(plan.packs) + len(plan.passthrough)
        alg, shards, _ = spec[entry]
        parts.append(f"{_name(alg, shards)}: {len(routed[entry])} tensors -> "
                     f"{len(plan.packs)} pack(s) + {len(plan.passthrough)} single(s)")
    return calls, "; ".join(parts)


def build_methods(config: BatchConfig, spec: AllReduceSpec, comm: Comm,
                  peers: Sequence[Any] = ()) -> list[Method]:
    """The rows of a batch run, in table order (the torch rows last, three per peer of
    ``peers``: :class:`~.peers.TorchPeer`)."""
    shapes, dtype, n = config.shapes, config.np_dtype, len(config.shapes)
    total = sum(int(np.prod(s, dtype=np.int64)) for s in shapes) * dtype.itemsize
    flat_alg, flat_shards, _ = spec.route(total)
    label = str(spec)

    def ops(**kwargs: Any) -> Any:
        return MultiWorkerAllReduce(all_reduce_spec=spec, comm=comm, **kwargs)

    methods = [
        Method("per-tensor native", "per-tensor", n, f"{n} x MPI_Allreduce(MPI_IN_PLACE)"),
        Method("per-tensor native, out of place", "per-tensor-oop", n,
               f"{n} x MPI_Allreduce(x, out), the inputs left alone"),
        Method("flat native", "flat-native", 1, "1 x MPI_Allreduce"),
        Method(f"flat {label}", "flat-spec", 1,
               f"dispatch.run({_name(flat_alg, flat_shards)!r}) on the flat buffer"),
        Method(f"flat {label} (batch_reduce)", "flat-batch", 1,
               "batch_reduce of one flat tensor, num_packs=0", ops(num_packs=0)),
    ]
    for packs in config.num_packs:
        calls, plan = _plan(spec, shapes, dtype, packs, 0, 0)
        methods.append(Method(f"batch_reduce num_packs={packs}", "batch", calls, plan,
                              ops(num_packs=packs), packs))
    if config.agg_bytes:
        calls, plan = _plan(spec, shapes, dtype, 0, config.agg_bytes, config.agg_group)
        methods.append(Method(
            f"batch_reduce agg {format_bytes(config.agg_bytes).replace(' ', '')}"
            f"/{config.agg_group}", "batch", calls, plan,
            ops(num_packs=0, agg_small_grads_max_bytes=config.agg_bytes,
                agg_small_grads_max_group=config.agg_group)))
    calls, plan = _plan(spec, shapes, dtype, 0, 0, 0)
    methods.append(Method("batch_reduce no packing", "batch", calls, plan, ops(num_packs=0)))
    if config.num_packs:
        packs = config.num_packs[0]
        calls, plan = _plan(spec, shapes, dtype, packs, 0, 0)
        where = "shared buffer" if config.shared else "one buffer"
        methods.append(Method(f"batch_reduce num_packs={packs}, {where}", "batch-views", calls,
                              f"{plan}; the tensors are views of "
                              f"{'one shared buffer' if config.shared else 'one array'}",
                              ops(num_packs=packs), packs))
    for peer in peers:
        name, backend = peer.label, peer.backend
        methods.append(Method(f"{name} per-tensor", "torch-each", n,
                              f"{n} x torch.distributed.all_reduce ({backend}), in place",
                              peer))
        if peer.coalesced:
            methods.append(Method(f"{name} all_reduce_coalesced", "torch-coalesced", 1,
                                  f"1 x torch.distributed.all_reduce_coalesced ({backend}) "
                                  f"of the {n} tensors, in place", peer))
        methods.append(Method(f"{name} flat (cat, split)", "torch-flat", 1,
                              f"torch.cat of the batch, 1 x torch.distributed.all_reduce "
                              f"({backend}), split and copied back into the tensors", peer))
    return methods


class BatchBench:
    """The batch's buffers and one call of each method (collective: every rank builds one)."""

    def __init__(self, comm: Comm, config: BatchConfig, spec: AllReduceSpec,
                 methods: list[Method]) -> None:
        self.comm, self.MPI, self.methods, self.config = comm, mpi(), methods, config
        self.run, self.SUM = dispatch.run, ReduceOp.SUM
        self.G = G = config.local_replicas
        dtype, rank = config.np_dtype, comm.Get_rank()
        self.shapes = config.shapes
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.total = int(self.offsets[-1])
        self.flat_in = []
        for d in range(G):
            flat = np.empty(self.total, dtype=dtype)
            fill_pattern(flat, rank * G + d)
            self.flat_in.append(flat)
        self.inputs = [[self.flat_in[d][o:o + n].reshape(s).copy()
                        for o, n, s in zip(self.offsets[:-1], self.sizes, self.shapes)]
                       for d in range(G)]
        self.work = [np.empty(s, dtype=dtype) for s in self.shapes]
        self.outs = [np.empty(s, dtype=dtype) for s in self.shapes]
        self.flat = np.empty(self.total, dtype=dtype)
        self.backend = get_backend(self.flat)
        self.pairs = [(v, v) for v in (PerReplica([self.inputs[d][i] for d in range(G)])
                                       for i in range(len(self.shapes)))]
        self.views: list[list[np.ndarray]] = []  # the batch as views of one buffer
        if any(m.kind == "batch-views" for m in methods):
            for d in range(G):
                views = shared_arrays(self.shapes, dtype, comm) if config.shared \
                    else flat_arrays(self.shapes, dtype)
                for view, x in zip(views, self.inputs[d]):
                    view[...] = x
                self.views.append(views)
        self.view_pairs = [(v, v) for v in (PerReplica([self.views[d][i] for d in range(G)])
                                            for i in range(len(self.shapes)))] \
            if self.views else []
        flat_value = PerReplica(list(self.flat_in))
        self.flat_pairs = [(flat_value, flat_value)]
        self.flat_alg, self.flat_shards, _ = spec.route(self.total * dtype.itemsize)
        self.ref: np.ndarray | None = None
        peer = next((m.ops for m in methods if m.kind.startswith("torch-")), None)
        # the batch as torch tensors, made once (every peer's rows reduce the same ones);
        # their .numpy() views refill and check them
        self.torch_tensors = peer.tensors(self.shapes, dtype) if peer is not None else []
        self.torch_views = [t.numpy() for t in self.torch_tensors]

    # -- untimed preparation, then the timed call

    def _prepare(self, m: Method) -> None:
        if self.G > 1:
            return  # the methods add the G components up themselves (timed)
        if m.kind == "per-tensor":
            for w, x in zip(self.work, self.inputs[0]):
                np.copyto(w, x)
        elif m.kind in ("flat-native", "flat-spec"):
            np.copyto(self.flat, self.flat_in[0])
        elif m.kind.startswith("torch-"):
            for view, x in zip(self.torch_views, self.inputs[0]):
                np.copyto(view, x)

    def _local_sum(self, out: np.ndarray, parts: list[np.ndarray]) -> None:
        np.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            np.add(out, part, out=out)

    def _call(self, m: Method, rotation: int) -> Any:
        comm, MPI = self.comm, self.MPI
        if m.kind == "per-tensor":
            for i, w in enumerate(self.work):
                if self.G > 1:
                    self._local_sum(w, [self.inputs[d][i] for d in range(self.G)])
                comm.Allreduce(MPI.IN_PLACE, w)
            return None
        if m.kind == "per-tensor-oop":
            for i, out in enumerate(self.outs):
                if self.G > 1:
                    self._local_sum(out, [self.inputs[d][i] for d in range(self.G)])
                    comm.Allreduce(MPI.IN_PLACE, out)
                else:
                    comm.Allreduce(self.inputs[0][i], out)
            return None
        if m.kind in ("flat-native", "flat-spec"):
            if self.G > 1:
                self._local_sum(self.flat, self.flat_in)
            if m.kind == "flat-native":
                comm.Allreduce(MPI.IN_PLACE, self.flat)
            else:
                self.run(self.flat_alg, comm, self.flat, op=self.SUM, shards=self.flat_shards,
                         backend=self.backend, rotation=rotation)
            return None
        if m.kind == "torch-each":
            m.ops.all_reduce_each(self.torch_tensors)
            return None
        if m.kind == "torch-coalesced":
            m.ops.all_reduce_coalesced(self.torch_tensors)
            return None
        if m.kind == "torch-flat":
            m.ops.all_reduce_flat(self.torch_tensors, self.sizes)
            return None
        pairs = {"flat-batch": self.flat_pairs, "batch-views": self.view_pairs}
        return m.ops.batch_reduce("sum", pairs.get(m.kind, self.pairs))

    def timed(self, k: int, rotation: int, check: bool) -> tuple[float, int]:
        """One iteration of method ``k``: (seconds, wrong elements or 0 when unchecked)."""
        m = self.methods[k]
        self._prepare(m)
        self.comm.Barrier()
        t0 = self.MPI.Wtime()
        result = self._call(m, rotation)
        t = self.MPI.Wtime() - t0
        wrong = self._wrong(m, result) if check else 0
        del result  # freed outside the timed region
        return t, wrong

    # -- correctness

    def check_all(self) -> list[int]:
        """One call of every method compared with per-tensor native's results (which are
        themselves compared with one flat MPI_Allreduce); this rank's wrong counts."""
        order = sorted(range(len(self.methods)),
                       key=lambda e: self.methods[e].kind != "per-tensor")
        wrong = [0] * len(self.methods)
        for e in order:
            m = self.methods[e]
            self._prepare(m)
            result = self._call(m, 0)
            if m.kind == "per-tensor":
                self.ref = np.concatenate([w.reshape(-1) for w in self.work])
                flat = self.flat_in[0].copy()
                for part in self.flat_in[1:]:
                    flat += part
                self.comm.Allreduce(self.MPI.IN_PLACE, flat)
                wrong[e] = int(np.count_nonzero(self.ref != flat))
            else:
                wrong[e] = self._wrong(m, result)
        return wrong

    def _wrong(self, m: Method, result: Any) -> int:
        ref = self.ref
        assert ref is not None, "check_all() runs first"
        if m.kind in ("per-tensor", "per-tensor-oop") or m.kind.startswith("torch-"):
            results = {"per-tensor": self.work, "per-tensor-oop": self.outs}.get(
                m.kind, self.torch_views)
            return sum(int(np.count_nonzero(w.reshape(-1) != ref[o:o + n]))
                       for w, o, n in zip(results, self.offsets[:-1], self.sizes))
        if m.kind in ("flat-native", "flat-spec"):
            return int(np.count_nonzero(self.flat != ref))
        shapes: Sequence[tuple[int, ...]]
        if m.kind == "flat-batch":
            spans, shapes = [(0, self.total)], [(self.total,)]
        else:
            spans, shapes = list(zip(self.offsets[:-1].tolist(), self.sizes)), self.shapes
        if not isinstance(result, list) or len(result) != len(spans):
            return self.total * self.G
        wrong = 0
        for (o, n), shape, mirrored in zip(spans, shapes, result):
            values = list(components_of(mirrored))
            if len(values) != self.G:
                wrong += n * self.G
                continue
            for v in values:
                v = np.asarray(v)
                if v.shape != tuple(shape) or v.dtype != ref.dtype:
                    wrong += n
                else:
                    wrong += int(np.count_nonzero(v.reshape(-1) != ref[o:o + n]))
        return wrong

    def inputs_modified(self) -> int:
        """Input elements ``batch_reduce`` changed (it must leave its inputs alone)."""
        modified = 0
        for d in range(self.G):
            for batch in [self.inputs[d]] + ([self.views[d]] if self.views else []):
                for x, o, n in zip(batch, self.offsets[:-1].tolist(), self.sizes):
                    modified += int(np.count_nonzero(x.reshape(-1) != self.flat_in[d][o:o + n]))
        return modified


def batch_table(points: Sequence[Point], methods: Sequence[Method],
                markdown: bool = False) -> str:
    """The batch's table: one row per method with its time ratios to per-tensor native and
    to the flat spec all-reduce, each in place and out of place (``oop``: new results, the
    inputs left alone — the same contract as ``batch_reduce``; for the flat spec, the
    flat buffer through ``batch_reduce``)."""
    ratios = [("time/per-tensor", "per-tensor"), ("time/per-tensor oop", "per-tensor-oop"),
              ("time/flat spec", "flat-spec"), ("time/flat oop", "flat-batch")]
    baselines = [next(p for p, m in zip(points, methods) if m.kind == kind)
                 for _, kind in ratios]
    heads = ["method", "calls", "iters", "time(ms)", "min(ms)", "max(ms)", "algbw(GB/s)",
             *(column for column, _ in ratios), "#wrong"]
    rows = []
    for p, m in zip(points, methods):
        rows.append([
            m.label, str(m.calls), str(len(p.samples)), f"{p.median * 1e3:.2f}",
            f"{p.min * 1e3:.2f}", f"{p.max * 1e3:.2f}", f"{p.algbw:.3g}",
            *(format_ratio(p.median / b.median if b.median > 0 else None) for b in baselines),
            str(p.wrong)])
    if markdown:
        lines = ["| " + " | ".join(heads) + " |",
                 "|:---|" + "|".join("---:" for _ in heads[1:]) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(heads)]

    def line(cells: Sequence[str], prefix: str = " ") -> str:
        return (prefix + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))).rstrip()

    return "\n".join([line(heads, "#")] + [line(r) for r in rows])
