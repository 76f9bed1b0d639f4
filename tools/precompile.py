"""Compile, on this GPU and in parallel, the kernels a bench run will launch: its later run finds them cached.

A fresh machine compiles every knob set through NVRTC when a variant is first built, one after another; with many
points that is minutes of one core. This compiles the knob sets of the given variants, models and batches in
parallel processes into CuPy's disk cache (``$CUPY_CACHE_DIR``), so the bench, the sweep or the tests that follow
load them. It launches nothing and times nothing.

    python -m tools.precompile --model qwen3-30b-a3b,qwen3-235b-a22b --batch 16,32,64 --variants 'cupy:warp-decode-mma*'
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from tools.cli import examples, int_list


def _dims(model: str, tokens: int) -> Any:
    from kernels.contract import Dims
    from kernels.shapes import PRESETS

    shape = PRESETS[model]
    return Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)


def _compile(job: tuple[str, dict[str, int], str]) -> str:
    """Compile one variant's knob set (``job``: name, the macros, a label) on this device."""
    from kernels.variants import get_variant

    name, params, label = job
    family = get_variant(name).kernel_family
    family.kernels_for(family.for_device(params))
    return f"ok {label}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.precompile", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=examples("python -m tools.precompile --model qwen3-30b-a3b --batch 1,8,64",
                        "python -m tools.precompile --variants 'cupy:warp-decode-mma*' --jobs 8"))
    parser.add_argument("--model", default="qwen3-30b-a3b", help="comma list of presets (default qwen3-30b-a3b)")
    parser.add_argument("--batch", type=int_list, default=[1, 2, 4, 8, 16, 32, 64],
                        help="comma list of batch sizes (default 1,2,4,8,16,32,64)")
    parser.add_argument("--variants", default="cupy:*",
                        help="comma list of variant names or globs (default: every cupy variant)")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                        help="compile processes (default: the CPUs less two)")
    args = parser.parse_args(argv)
    from kernels.shapes import PRESETS
    from kernels.variants import load_builtin

    models = [m.strip() for m in args.model.split(",") if m.strip()]
    unknown = [m for m in models if m not in PRESETS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {', '.join(PRESETS)}")
    registry = load_builtin()
    names = sorted({n for pattern in args.variants.split(",") for n in registry if fnmatch.fnmatch(n, pattern.strip())})
    if not names:
        parser.error(f"no registered variant matches {args.variants!r}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    jobs, seen = [], set()
    for name, model, tokens in ((n, m, t) for n in names for m in models for t in args.batch):
        variant = registry[name]
        params = variant.compiled_params(_dims(model, tokens))
        key = None if params is None else (variant.source.name, tuple(sorted(params.items())))
        if key is not None and key not in seen:  # one process per distinct text
            seen.add(key)
            jobs.append((name, params, f"{name} {model} T={tokens}"))
    print(f"compiling {len(jobs)} distinct knob sets in {args.jobs} processes", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for i, line in enumerate(pool.map(_compile, jobs)):
            print(f"[{i + 1}/{len(jobs)} {time.perf_counter() - start:.0f}s] {line}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
