"""What each short stage of a batched layer costs inside the layer's PDL chain (added 2026-12-03, for where the
list kernel and the slot sum leave the layer's time).

The bench times a layer's stages one by one (each stage alone in its own graph): a short stage then shows its
launch gap and latency, not what it adds between PDL-chained neighbours. Here the whole layer is timed as the bench
times it (a graph of layer calls, each on its own weight copy, weights rotated past 3x L2), then again with one
short stage left out: the list kernel (its lists are the previous call's, the same routing, so the later stages do
the same work) or the slot sum (the output is then not written: timing only). The difference is that stage's cost
in the chain. Run on a GPU from the repo root:

    PYTHONPATH=. python3 notes/diag_stage_cost.py --json F [--model M] [--batch 16,32] [--routing zipf] [VARIANTS]
"""

from __future__ import annotations

import argparse
import json
import sys

from kernels.shapes import get_shape
from kernels.variants import get_variant
from tools.harness import Workbench, summarize

LEFT_OUT = {"layer": (), "no-lists": ("expert_lists",), "no-sum": ("sum",), "no-lists-no-sum": ("expert_lists", "sum")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=["cupy:warp-decode-mma", "cupy:warp-decode-mma-grouped"])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--batch", default="16,32,64")
    parser.add_argument("--routing", default="zipf")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    import cupy

    rows = []
    for model in args.model.split(","):
        for tokens in (int(t) for t in args.batch.split(",")):
            bench = Workbench(get_shape(model), tokens, routing=args.routing)
            for name in args.variants:
                variant = get_variant(name)
                launch = variant.make(bench.dims)
                outs = [cupy.empty((tokens, bench.shape.hidden), dtype=bench.x.dtype) for _ in range(bench.copies)]
                per_copy = [launch.stages(bench.x, *bench.weights(c), bench.topk_ids, bench.topk_weights, outs[c])
                            for c in range(bench.copies)]
                stream = cupy.cuda.Stream(non_blocking=True)
                with stream:
                    for stages in per_copy:
                        for _, fn in stages:
                            fn()
                stream.synchronize()
                row = {"variant": name, "model": model, "batch": tokens, "routing": args.routing,
                       "stages": [s for s, _ in per_copy[0]]}
                for key, skip in LEFT_OUT.items():
                    if any(s not in row["stages"] for s in skip):
                        continue
                    fns = [lambda st=stages, sk=skip: [fn() for s, fn in st if s not in sk] for stages in per_copy]
                    samples, mode, _ = bench._time(stream, fns, args.repeats)
                    row[key] = {"timing_mode": mode, "samples_us": samples, **summarize(samples)}
                bench._last = []
                rows.append(row)
                print(name, model, tokens, {k: round(row[k]["median_us"], 2) for k in LEFT_OUT if k in row},
                      flush=True)
            bench.free()
    with open(args.json, "w") as f:
        json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
