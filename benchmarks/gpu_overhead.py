"""GPU overhead benchmarks (run on a GPU machine; rank 0 prints one line per result).

1. NCCL all-reduce through mpistrat vs the raw ``cupy.cuda.nccl`` call at 1 KiB, 1 MiB,
   64 MiB (the wrapper's overhead):   mpiexec -n 1 python benchmarks/gpu_overhead.py nccl
2. the staged ring on 2 ranks vs a naive ``asnumpy`` + native ``Allreduce`` + copy back at
   1-256 MiB (target: >= 1.5x faster at >= 16 MiB):
       MPISTRAT_CUDA_AWARE_MPI=0 mpiexec -n 2 python benchmarks/gpu_overhead.py staged
3. ``NcclAllReduce.batch_reduce`` of ResNet-50's 161 gradient tensors (CuPy, in place) vs
   one NCCL all-reduce of a flat buffer of the same 97.5 MiB (target: <= 1.1x):
       mpiexec -n 1 python benchmarks/gpu_overhead.py batch
   (``--spec xring`` on 2 ranks sharing the GPU: the same through the staged ring, packed
   into ``--num-packs`` buffers, default 1)
4. writing ResNet-50's 161 tensors back from one buffer: one kernel launch
   (``copy_many``) vs a copy per tensor:   python benchmarks/gpu_overhead.py copies

Timing: barrier, warm-up iterations dropped, ``MPI.Wtime`` around ``iters`` calls, the
max over ranks, the median of ``repeats`` such runs.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import cupy
import numpy as np
from mpi4py import MPI

from mpistrat import ReduceOp, dispatch
from mpistrat.algorithms import nccl, ring
from mpistrat.backends import get_backend

COMM = MPI.COMM_WORLD


def _time(fn, iters=20, warmup=5, repeats=5):
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        COMM.Barrier()
        t0 = MPI.Wtime()
        for _ in range(iters):
            fn()
        cupy.cuda.get_current_stream().synchronize()
        samples.append(COMM.allreduce((MPI.Wtime() - t0) / iters, op=MPI.MAX))
    return statistics.median(samples)


def _say(text):
    if COMM.rank == 0:
        print(text, flush=True)


def bench_nccl():
    device = COMM.rank % cupy.cuda.runtime.getDeviceCount()
    with cupy.cuda.Device(device):
        for nbytes in (1 << 10, 1 << 20, 64 << 20):
            buf = cupy.ones(nbytes // 4, dtype=cupy.float32)
            backend = get_backend(buf)
            (raw,) = nccl.communicators(COMM, [device])
            stream = cupy.cuda.get_current_stream()

            def direct():
                raw.allReduce(buf.data.ptr, buf.data.ptr, buf.size, nccl._nccl().NCCL_FLOAT32,
                              nccl._nccl().NCCL_SUM, stream.ptr)
                stream.synchronize()

            def wrapped():
                nccl.all_reduce(COMM, buf, op=ReduceOp.SUM, backend=backend)

            t_raw, t_ours = _time(direct), _time(wrapped)
            _say(f"nccl {nbytes:>10d} B  raw {t_raw * 1e6:9.1f} us  mpistrat "
                 f"{t_ours * 1e6:9.1f} us  overhead {(t_ours - t_raw) * 1e6:7.1f} us")


def bench_staged():
    device = 0
    with cupy.cuda.Device(device):
        for mib in (1, 4, 16, 64, 256):
            buf = cupy.ones(mib * (1 << 18), dtype=cupy.float32)
            backend = get_backend(buf)
            host = np.empty(buf.size, dtype=np.float32)

            def naive():
                cupy.asnumpy(buf, out=host)
                COMM.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
                buf.set(host)

            def staged():
                ring.all_reduce(COMM, buf, op=ReduceOp.SUM, backend=backend)

            t_naive, t_staged = _time(naive, iters=5), _time(staged, iters=5)
            _say(f"staged {mib:>4d} MiB  naive {t_naive * 1e3:8.2f} ms  staged ring "
                 f"{t_staged * 1e3:8.2f} ms  speedup {t_naive / t_staged:5.2f}x")


def bench_batch(spec, num_packs):
    from mpistrat import MultiWorkerAllReduce, NcclAllReduce, PerReplica
    from mpistrat.bench.shapes import resnet50_gradient_shapes

    device = COMM.rank % cupy.cuda.runtime.getDeviceCount()
    with cupy.cuda.Device(device):
        grads = [cupy.ones(shape, dtype=cupy.float32) for shape in resnet50_gradient_shapes()]
        flat = cupy.ones(sum(g.size for g in grads), dtype=cupy.float32)
        backend = get_backend(flat)
        ops = NcclAllReduce(comm=COMM) if spec == "nccl" else \
            MultiWorkerAllReduce(all_reduce_spec=spec, num_packs=num_packs, comm=COMM)
        flat_reduce = nccl.all_reduce if spec == "nccl" else functools.partial(
            dispatch.implementation(spec).all_reduce, shards=1, rotation=0)
        # each gradient is this rank's one GPU replica, reduced into itself
        pairs = [(PerReplica([g], ["/gpu:0"]), "/gpu:0") for g in grads]

        def batched():
            ops.batch_reduce(ReduceOp.SUM, pairs, inplace=True)

        def one_buffer():
            flat_reduce(COMM, flat, op=ReduceOp.SUM, backend=backend)

        t_flat, t_batch = _time(one_buffer, iters=10), _time(batched, iters=10)
        packs = "" if spec == "nccl" else f" num_packs={num_packs}"
        _say(f"batch {spec}{packs} {COMM.size} rank(s), {len(grads)} tensors, "
             f"{flat.nbytes / 2**20:.1f} MiB  one buffer {t_flat * 1e3:8.2f} ms  "
             f"batch_reduce {t_batch * 1e3:8.2f} ms  ratio {t_batch / t_flat:5.2f}x")


def bench_copies():
    """Writing a batch back (ResNet-50's 161 tensors): one launch vs a copy per tensor."""
    from mpistrat.bench.shapes import resnet50_gradient_shapes

    with cupy.cuda.Device(0):
        grads = [cupy.ones(shape, dtype=cupy.float32) for shape in resnet50_gradient_shapes()]
        flat = cupy.ones(sum(g.size for g in grads), dtype=cupy.float32)
        views, at = [], 0
        for g in grads:
            views.append(flat[at:at + g.size].reshape(g.shape))
            at += g.size
        backend = get_backend(flat)

        def one_by_one():
            for g, v in zip(grads, views):
                backend.copy(g, v)

        def batched():
            backend.copy_many(grads, views)

        t_loop, t_one = _time(one_by_one, iters=10), _time(batched, iters=10)
        _say(f"copies 161 tensors, {flat.nbytes / 2**20:.1f} MiB  one by one "
             f"{t_loop * 1e3:8.2f} ms  one launch {t_one * 1e3:8.2f} ms  "
             f"speedup {t_loop / t_one:5.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("which", choices=["nccl", "staged", "batch", "copies"])
    parser.add_argument("--spec", default="nccl",
                        help="batch: the algorithm (nccl at one rank per GPU; xring, rechd "
                             "on ranks sharing a GPU)")
    parser.add_argument("--num-packs", type=int, default=1,
                        help="batch, other than nccl: MultiWorkerAllReduce's num_packs (1: "
                             "one pack, as NcclAllReduce; 0: each tensor alone, TF's default)")
    args = parser.parse_args()
    if args.which == "batch":
        bench_batch(args.spec, args.num_packs)
    else:
        {"nccl": bench_nccl, "staged": bench_staged, "copies": bench_copies}[args.which]()
