"""``python -m tools.multi``: one MoE layer split over ranks -- tensor or expert parallel -- one process per rank.

    python -m tools.multi --split tp --ranks 4 --model qwen3-235b-a22b --batch 1,64          # NCCL, a GPU a rank
    python -m tools.multi --split ep --ranks 3 --model tiny --batch 5 --backend reference    # the host stand-in

The tool starts one process per rank (multiprocessing, spawn). Each builds its shard of the layer
(:mod:`kernels.sharding`; the weights generated from ``--seed``, the same in every rank), computes its partial output
[T, H] in float32, and the partials are summed:

``nccl``       on the GPUs, one a rank: the shard through ``kernels.batched.warp_decode_batched`` (the tensor-core
               path, the layer's activation and biases) into a float32 partial, summed by an all-reduce over NCCL
               (CuPy's ``cupy.cuda.nccl``), rank 0's result checked. Written for the 2- and 4-GPU machines; not yet
               run on one.
``reference``  on the host: each rank runs ``kernels.reference.moe_decode`` on its shard and the tool sums the
               partials in rank order -- the launcher, the split and the error paths checked on any machine.

Either way the sum, rounded to bf16 once, is checked against the whole layer's reference (``kernels.checks``, the
tensor-core tolerance). A rank that raises stops the run: the tool names the rank and its error, stops the others and
exits 1; one that dies without a word is named with its exit code; ``--timeout`` bounds the wait. Progress goes to
stderr from the first second. Without a GPU, backend nccl says so and exits 0 (NO RUN).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import queue
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tools.cli import examples, int_list, positive_int

SPLITS = ("tp", "ep")
BACKENDS = ("nccl", "reference")
CHECKED_EXPERTS = 16  # --experts default: a preset's experts capped (the host runs the whole layer's reference)


class RankFailed(RuntimeError):
    """A rank raised or died: ``rank``, and what it said (its traceback) or its exit code."""

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(f"rank {rank} failed: {why}")
        self.rank = rank
        self.why = why


def _rank_main(target: Callable[..., Any], rank: int, ranks: int, payload: Any, results: Any) -> None:
    try:
        results.put(("ok", rank, target(rank, ranks, payload)))
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the launcher, named
        results.put(("error", rank, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def launch(target: Callable[[int, int, Any], Any], ranks: int, payload: Any, timeout: float = 600.0,
           progress: Callable[[str], None] | None = None) -> list[Any]:
    """``[target(rank, ranks, payload) for rank in range(ranks)]``, each in a process of its own (spawn: ``target``
    a module-level function, ``payload`` picklable); RankFailed for the first rank that raises or exits without a
    result (the others are stopped), TimeoutError after ``timeout`` seconds."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank_main, args=(target, rank, ranks, payload, results), daemon=True)
                 for rank in range(ranks)]
    for process in processes:
        process.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < ranks:
            try:
                status, rank, value = results.get(timeout=0.2)
            except queue.Empty:
                for rank, process in enumerate(processes):
                    if rank not in got and process.exitcode not in (None, 0):
                        raise RankFailed(rank, f"exited with code {process.exitcode} before giving a result") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(ranks)) - set(got))} gave no result within "
                                       f"{timeout:g} s") from None
                continue
            if status == "error":
                raise RankFailed(rank, value)
            got[rank] = value
            if progress is not None:
                progress(f"rank {rank} done ({len(got)} of {ranks})")
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join(timeout=5)
    return [got[rank] for rank in range(ranks)]


@dataclass(frozen=True)
class Job:
    """What every rank runs: the split, the layer (preset, T, seed, routing, format) and the backend."""

    split: str
    model: str
    tokens: int
    seed: int
    routing: str
    weight_format: str
    backend: str
    experts: int = CHECKED_EXPERTS  # the preset's experts capped at this (0: none)


def _problem(job: Job) -> Any:
    from kernels.formats import quantize_weights
    from kernels.problem import make_problem
    from kernels.shapes import get_shape

    shape = get_shape(job.model)
    if job.experts:
        shape = shape.with_(experts=min(shape.experts, job.experts))
    p = make_problem(shape, job.tokens, seed=job.seed, routing=job.routing)
    if job.weight_format != "bf16":
        q13, q2 = quantize_weights(p.w13, p.w2, job.weight_format)
        p = dataclasses.replace(p, w13=q13, w2=q2)
    return p


def reference_rank(rank: int, ranks: int, job: Job) -> np.ndarray:
    """Backend reference: this rank's float32 partial output, the reference on its shard."""
    from kernels.reference import moe_decode
    from kernels.sharding import shard

    p = _problem(job)
    mine = shard(p.w13, p.w2, job.split, ranks, p.b13, p.b2)[rank]
    ids, weights = mine.route(p.topk_ids, p.topk_weights)
    return moe_decode(p.x, mine.w13, mine.w2, ids, weights, mode="warp_decode", activation=p.shape.activation,
                      b13=mine.b13, b2=mine.b2, out_dtype=np.float32)


def nccl_rank(rank: int, ranks: int, payload: tuple[Job, Any]) -> np.ndarray | None:
    """Backend nccl: this rank's shard on GPU ``rank`` into a float32 partial, all-reduced over NCCL; rank 0 returns
    the sum (on the host), the others None."""
    import cupy
    from cupy.cuda import nccl

    from kernels import batched
    from kernels.problem import convert_array
    from kernels.sharding import shard

    job, unique_id = payload
    cupy.cuda.Device(rank).use()
    comm = nccl.NcclCommunicator(ranks, unique_id, rank)
    p = _problem(job)
    mine = shard(p.w13, p.w2, job.split, ranks, p.b13, p.b2)[rank]
    ids, weights = mine.route(p.topk_ids, p.topk_weights)

    def device(a: Any) -> Any:
        return convert_array(a, cupy.asarray)

    partial = cupy.empty((job.tokens, p.shape.hidden), dtype=cupy.float32)
    biases = {"b13": device(mine.b13), "b2": device(mine.b2)} if mine.b13 is not None else {}
    batched.warp_decode_batched(device(p.x), device(mine.w13), device(mine.w2), cupy.asarray(ids),
                                cupy.asarray(weights), out=partial, path="mma", activation=p.shape.activation,
                                **biases)
    total = cupy.empty_like(partial)
    stream = cupy.cuda.get_current_stream()
    comm.allReduce(partial.data.ptr, total.data.ptr, partial.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    stream.synchronize()
    return cupy.asnumpy(total) if rank == 0 else None


def _devices() -> tuple[int, str | None]:
    """(visible GPUs, why none) for backend nccl: the harness's probe (tools.gpu), then NCCL in CuPy."""
    from tools.gpu import gpu_available

    available, why = gpu_available()
    if not available:
        return 0, why
    try:
        import cupy
        from cupy.cuda import nccl  # noqa: F401
    except ImportError as error:
        return 0, f"backend nccl needs CuPy with NCCL: {error}"
    return int(cupy.cuda.runtime.getDeviceCount()), None


def run(job: Job, ranks: int, timeout: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """One split layer: the ranks' sum against the whole layer's reference (a record for the table)."""
    from kernels.checks import OWN_ORDER, check_output
    from kernels.numerics import round_bf16
    from kernels.reference import moe_decode

    start = time.perf_counter()
    if job.backend == "reference":
        partials = launch(reference_rank, ranks, job, timeout, progress)
        total = partials[0]
        for part in partials[1:]:
            total = total + part
    else:
        from cupy.cuda import nccl

        total = launch(nccl_rank, ranks, (job, nccl.get_unique_id()), timeout, progress)[0]
    seconds = time.perf_counter() - start
    p = _problem(job)
    faithful = moe_decode(*p.arrays, mode="warp_decode", **p.layer)
    oracle = moe_decode(*p.arrays, mode="fp64", **p.layer)
    record = check_output(round_bf16(total), faithful, OWN_ORDER, oracle=oracle)
    return {"split": job.split, "ranks": ranks, "model": p.shape.name, "tokens": job.tokens,
            "format": job.weight_format, "backend": job.backend, "ok": bool(record["ok"]), "why": record.get("why", ""),
            "rel_l2_fp64": record["rel_l2_fp64"], "seconds": seconds}


def main(argv: Sequence[str] | None = None) -> int:
    from kernels.formats import FORMATS
    from kernels.routing import GENERATORS
    from kernels.shapes import PRESETS
    from kernels.sharding import check_ranks

    parser = argparse.ArgumentParser(
        prog="python -m tools.multi", description=__doc__.split("\n\n")[0].strip("`"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=examples("python -m tools.multi --split tp --ranks 4 --model qwen3-235b-a22b --batch 1,64",
                        "python -m tools.multi --split ep --ranks 3 --model tiny --batch 5 --backend reference"))
    parser.add_argument("--split", choices=SPLITS, default="tp",
                        help="tensor (tp) or expert (ep) parallel (default tp)")
    parser.add_argument("--ranks", type=positive_int, default=2, help="processes, one a GPU with nccl (default 2)")
    parser.add_argument("--model", choices=sorted(PRESETS), default="qwen3-30b-a3b",
                        help="preset (default qwen3-30b-a3b)")
    parser.add_argument("--batch", type=int_list, default=[1, 8], help="T values (default 1,8)")
    parser.add_argument("--format", choices=[f for f in FORMATS if not FORMATS[f].tiled], default="bf16",
                        dest="weight_format", help="the experts' weight format (default bf16)")
    parser.add_argument("--routing", choices=sorted(GENERATORS), default="uniform",
                        help="routing generator (default uniform)")
    parser.add_argument("--backend", choices=BACKENDS, default="nccl",
                        help="nccl: a GPU a rank, an all-reduce; reference: the host (default nccl)")
    parser.add_argument("--experts", type=int, default=CHECKED_EXPERTS,
                        help=f"cap the preset's experts (default {CHECKED_EXPERTS}: the host checks the whole layer's "
                             "reference; 0 = none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the routing (default 0)")
    parser.add_argument("--timeout", type=positive_int, default=600, help="seconds for all ranks (default 600)")
    args = parser.parse_args(argv)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.backend == "nccl":
        count, why = _devices()
        if why is not None:
            print(f"NO RUN: {why}; --backend reference runs the split on the host")
            return 0
        if args.ranks > count:
            parser.error(f"--ranks {args.ranks}: backend nccl runs a rank a GPU and this machine has {count}")
    if args.experts < 0:
        parser.error(f"--experts: expected an int >= 0, got {args.experts}")
    shape = PRESETS[args.model]
    experts = min(shape.experts, args.experts) if args.experts else shape.experts
    try:  # before any rank builds its shard
        check_ranks(args.split, args.ranks, shape.intermediate, experts, args.weight_format)
    except ValueError as error:
        parser.error(f"--ranks {args.ranks}: {error}")
    failed = False
    for tokens in args.batch:
        job = Job(args.split, args.model, tokens, args.seed, args.routing, args.weight_format, args.backend,
                  args.experts)
        progress(f"{args.split} x {args.ranks} {args.model} T={tokens} ({args.backend}): starting {args.ranks} ranks")
        try:
            record = run(job, args.ranks, float(args.timeout), progress)
        except (RankFailed, TimeoutError) as error:
            print(f"FAILED: {error}", file=sys.stderr)
            return 1
        failed |= not record["ok"]
        print(f"{record['split']} x {record['ranks']} {record['model']} T={record['tokens']} {record['format']}: "
              f"{'ok' if record['ok'] else 'WRONG: ' + str(record['why'])}, rel-L2 to fp64 "
              f"{record['rel_l2_fp64']:.2e}, {record['seconds']:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
