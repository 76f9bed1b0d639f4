"""Memory rooflines measured in the bench's own process, and the arithmetic that compares against them.

Three figures, every run:

``read``        a streaming-read kernel: 16-byte loads, a grid of 8 blocks x 512 threads per SM striding over
                ~4 GiB, XOR-reduced so the loads are not dead code. This is the ceiling for a decode kernel,
                which only *reads* weights; "% of roofline" in the report means % of this figure.
``d2d_memcpy``  ``cudaMemcpyAsync`` device-to-device captured in a CUDA graph, read + write bytes counted.
``copy16``      the same copy with a 16-byte-per-lane kernel (read + write bytes).

beside the datasheet figure for the GPU (``DATASHEET_TBPS``, matched by name; unknown GPUs say so).
The CUDA source goes through :mod:`kernels.compile` (the one compile path) and is registered there so
``tools.compile_report`` lists it. Pure arithmetic (``percent``, ``bar``, ``tbps``) needs no GPU.

    python -m tools.roofline [--repeats N] [--json PATH]     measure and print the three figures (no GPU: says so)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kernels.compile import CudaSource, get_kernel, register_source
from tools.cli import examples, positive_int
from tools.gpu import capture, gpu_available

# Peak HBM bandwidth from the vendors' datasheets, TB/s (10^12 bytes/s). First matching substring wins.
DATASHEET_TBPS: tuple[tuple[str, float], ...] = (
    ("GH200", 4.0),
    ("H200", 4.8),
    ("H100 PCIe", 2.0),
    ("H100 NVL", 3.9),
    ("H100", 3.35),  # SXM5 80 GB HBM3
    ("H800", 3.35),
    ("B200", 8.0),
    ("A100-SXM4-80GB", 2.039),
    ("A100 80GB PCIe", 1.935),
    ("A100", 1.555),  # 40 GB parts
    ("L40S", 0.864),
)

BLOCKS_PER_SM = 8
THREADS_PER_BLOCK = 512
READ_BYTES_TARGET = 4 << 30  # ~4 GiB streamed per read measurement
COPY_BYTES_TARGET = 1 << 30  # 1 GiB source + 1 GiB destination per copy measurement

ROOFLINE_SOURCE = register_source(
    CudaSource(
        name="roofline",
        description="bench rooflines: streaming read and 16-byte copy (tools/roofline.py)",
        kernels=("stream_read", "copy16"),
        defaults={},
        code=r"""
// Each thread walks the buffer with a grid stride, one 16-byte (uint4) load per step, and XORs what
// it loads into a register; the (practically never true) comparison at the end keeps the loads live.
extern "C" __global__ void stream_read(const uint4* __restrict__ src, unsigned long long n16,
                                       unsigned int* __restrict__ sink) {
    uint4 acc = make_uint4(0u, 0u, 0u, 0u);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride) {
        const uint4 v = __ldg(src + i);
        acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9E3779B9u) atomicAdd(sink, 1u);
}

// Grid-stride copy, 16 bytes per lane per step.
extern "C" __global__ void copy16(const uint4* __restrict__ src, uint4* __restrict__ dst, unsigned long long n16) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride) {
        dst[i] = src[i];
    }
}
""",
    )
)


# ------------------------------------------------------------------------------------------------
# Arithmetic (no GPU)
# ------------------------------------------------------------------------------------------------
def datasheet_tbps(gpu_name: str) -> float | None:
    """The datasheet HBM bandwidth for ``gpu_name`` in TB/s, or None when the GPU is not in the table."""
    for pattern, value in DATASHEET_TBPS:
        if pattern.lower() in gpu_name.lower():
            return value
    return None


def tbps(nbytes: float, microseconds: float) -> float:
    """Bytes moved in ``microseconds`` -> TB/s (10^12 bytes per second)."""
    if microseconds <= 0:
        raise ValueError(f"microseconds must be > 0, got {microseconds}")
    return nbytes / (microseconds * 1e-6) / 1e12


def percent(value_tbps: float | None, roof_tbps: float | None) -> float | None:
    """``value`` as a percentage of ``roof`` (None when either is unknown or the roof is not positive)."""
    if value_tbps is None or roof_tbps is None or roof_tbps <= 0:
        return None
    return 100.0 * value_tbps / roof_tbps


_EIGHTHS = " ▏▎▍▌▋▊▉"


def bar(pct: float | None, width: int = 20) -> str:
    """A bar of ``width`` cells filled to ``pct`` percent (clamped to [0, 100]) with eighth-cell resolution."""
    if pct is None:
        return " " * width
    eighths = round(max(0.0, min(100.0, pct)) / 100.0 * width * 8)
    full, part = divmod(eighths, 8)
    text = "█" * full + (_EIGHTHS[part] if part else "")
    return text.ljust(width)


# ------------------------------------------------------------------------------------------------
# Measurement (GPU)
# ------------------------------------------------------------------------------------------------
def time_graph_replays(graph: Any, stream: Any, repeats: int, inner: int,
                       reset: Callable[[], None] | None = None) -> list[float]:
    """Per-replay microseconds of ``graph``: a warm-up replay, then ``repeats`` samples of ``inner`` back-to-back
    replays between CUDA events; ``reset`` (on ``stream``, outside the events) before the warm-up and each sample."""
    import cupy

    def prepare() -> None:
        if reset is not None:
            with stream:
                reset()

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    prepare()
    graph.launch(stream)  # warm-up
    stream.synchronize()
    samples = []
    for _ in range(repeats):
        prepare()
        start.record(stream)
        for _ in range(inner):
            graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / inner)
    return samples


def _ptr(arr: Any) -> int:
    return arr.data.ptr


def time_launches(launches: list[Any], repeats: int = 20, inner: int = 5) -> list[float]:
    """Microseconds per launch: the callables in ``launches`` run once (compile, first touch), then captured as one
    CUDA graph and timed by :func:`time_graph_replays` (``repeats`` samples of ``inner`` replays, warm-up outside)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for fn in launches:
            fn()
    stream.synchronize()
    graph = capture(stream, lambda: [fn() for fn in launches])
    return [sample / len(launches) for sample in time_graph_replays(graph, stream, repeats, inner)]


def window_read_buffers(total: int = 4 << 30) -> tuple[Any, Any, Any]:
    """The 4 GiB source (nonzero words), the one-word sink and the stream that :func:`window_read_samples` reads
    through (notes/diag_*.py: reads of one layer's size)."""
    import cupy

    source = cupy.empty(total // 4, dtype=cupy.uint32)
    source.fill(0x01020304)
    return source, cupy.zeros(1, dtype=cupy.uint32), cupy.cuda.Stream(non_blocking=True)


def window_read_row(samples: list[float], nbytes: int, **fields: Any) -> dict[str, Any]:
    """One JSON row of a diagnostic's sized read: ``fields``, then the median, min and TB/s of ``samples`` (µs)."""
    median = statistics.median(samples)
    return {**fields, "median_us": median, "min_us": min(samples), "tbps": nbytes / median / 1e6}


def window_read_samples(read: Any, grid: int, block: int, source: Any, sink: Any, stream: Any, nbytes: int,
                        parts: list[tuple[int, int]] | None = None, layers: int = 48,
                        repeats: int = 10) -> list[float]:
    """Microseconds per read of ``nbytes`` by ``read`` (a ``stream_read``-shaped kernel: src, 16-byte count,
    sink): one CUDA graph of ``layers`` reads, each of the next ``nbytes`` window of ``source`` (cycling, so
    that a large ``source`` keeps the reads out of L2); ``parts`` ((offset, size) pairs inside a window) split each
    read into that many launches. ``repeats`` samples after a warm-up (notes/diag_*.py: reads of one layer's size)."""
    import cupy

    windows = max(1, min(layers, source.nbytes // nbytes))
    parts = parts or [(0, nbytes)]

    def body() -> None:
        for layer in range(layers):
            base = (layer % windows) * nbytes
            for offset, size in parts:
                view = source[(base + offset) // 4:(base + offset + size) // 4]
                read((grid,), (block,), (view, cupy.uint64(size // 16), sink))

    with stream:
        body()  # compile + first touch outside the graph
    stream.synchronize()
    return [s / layers for s in time_graph_replays(capture(stream, body), stream, repeats, 1)]


def measure(repeats: int = 10, read_bytes: int = READ_BYTES_TARGET, copy_bytes: int = COPY_BYTES_TARGET) -> dict:
    """Measure the three rooflines on the current GPU; returns the JSON-ready ``rooflines`` record."""
    import cupy

    runtime = cupy.cuda.runtime
    props = runtime.getDeviceProperties(cupy.cuda.Device().id)
    sms = int(props["multiProcessorCount"])
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    free, _ = runtime.memGetInfo()
    read_bytes = min(read_bytes, int(free * 0.25)) // (1 << 20) * (1 << 20)
    copy_bytes = min(copy_bytes, int(free * 0.125)) // (1 << 20) * (1 << 20)
    grid, block = BLOCKS_PER_SM * sms, THREADS_PER_BLOCK
    stream = cupy.cuda.Stream(non_blocking=True)
    record: dict[str, Any] = {
        "datasheet_tbps": datasheet_tbps(name),
        "grid": [grid, block],
        "read_bytes": read_bytes,
        "copy_bytes": copy_bytes,
    }

    read_kernel = get_kernel(ROOFLINE_SOURCE, "stream_read")
    src = cupy.empty(read_bytes // 16 * 4, dtype=cupy.uint32)
    src.fill(0x01020304)
    sink = cupy.zeros(1, dtype=cupy.uint32)
    n16 = cupy.uint64(read_bytes // 16)
    with stream:
        read_kernel((grid,), (block,), (src, n16, sink))  # compile + first touch outside timing
    stream.synchronize()
    graph = capture(stream, lambda: read_kernel((grid,), (block,), (src, n16, sink)))
    samples = time_graph_replays(graph, stream, repeats, 2)
    record["read_samples_us"] = samples
    record["read_tbps"] = tbps(read_bytes, statistics.median(samples))
    record["read_best_tbps"] = tbps(read_bytes, min(samples))
    src = graph = None  # free the 4 GiB before the copy buffers

    a = cupy.empty(copy_bytes // 4, dtype=cupy.uint32)
    b = cupy.empty_like(a)
    a.fill(7)
    kind = runtime.memcpyDeviceToDevice
    graph = capture(stream, lambda: runtime.memcpyAsync(_ptr(b), _ptr(a), copy_bytes, kind, stream.ptr))
    samples = time_graph_replays(graph, stream, repeats, 4)
    record["d2d_memcpy_samples_us"] = samples
    record["d2d_memcpy_tbps"] = tbps(2 * copy_bytes, statistics.median(samples))

    copy_kernel = get_kernel(ROOFLINE_SOURCE, "copy16")
    c16 = cupy.uint64(copy_bytes // 16)
    graph = capture(stream, lambda: copy_kernel((grid,), (block,), (a, b, c16)))
    samples = time_graph_replays(graph, stream, repeats, 4)
    record["copy16_samples_us"] = samples
    record["copy16_tbps"] = tbps(2 * copy_bytes, statistics.median(samples))
    if not bool((b[:: max(1, b.size // 4096)] == 7).all()):
        record["copy16_error"] = "copy16 did not copy the buffer"
    a = b = graph = None
    cupy.get_default_memory_pool().free_all_blocks()
    return record


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
FIGURES = (("read", "read_tbps", "streaming read"), ("d2d_memcpy", "d2d_memcpy_tbps", "memcpy D2D (read+write)"),
           ("copy16", "copy16_tbps", "16-byte copy (read+write)"))


def _gpu_name() -> str | None:
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    except Exception:  # noqa: BLE001 - the name is decoration
        return None
    return name.decode() if isinstance(name, bytes) else str(name)


def format_record(record: dict[str, Any], gpu: str | None = None) -> list[str]:
    """The lines ``main`` prints for a ``measure()`` record: each figure in TB/s and as % of the datasheet."""
    sheet = record.get("datasheet_tbps")
    known = f"datasheet {sheet:.2f} TB/s" if sheet is not None else "datasheet unknown for this GPU"
    lines = [f"rooflines on {gpu or 'this GPU'} ({known})"]
    for key, field_, label in FIGURES:
        value = record.get(field_)
        if value is None:
            continue
        pct = percent(value, sheet)
        share = f"{bar(pct)} {pct:3.0f}%" if pct is not None else ""
        best = f", best {record['read_best_tbps']:.2f} TB/s" if key == "read" and "read_best_tbps" in record else ""
        lines.append(f"  {key:<11s}{value:6.2f} TB/s  {share}  {label}{best}".rstrip())
    if record.get("copy16_error"):
        lines.append(f"  error: {record['copy16_error']}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tools.roofline``: measure the rooflines on this GPU and print them; without one, say so."""
    parser = argparse.ArgumentParser(prog="python -m tools.roofline",
                                     description="Measure the memory rooflines (streaming read, copies) on this GPU.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=examples(
                                         "python -m tools.roofline                     # without a GPU: says so",
                                         "python -m tools.roofline --repeats 20 --json results/roofline.json"))
    parser.add_argument("--repeats", type=positive_int, default=10, metavar="N",
                        help="timed samples per figure (default %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="also write the measured record here (default: not written)")
    args = parser.parse_args(argv)

    gpu, why = gpu_available()
    if not gpu:
        print(f"no CUDA GPU ({why}): no roofline measured")
        return 0
    record = measure(repeats=args.repeats)
    name = _gpu_name()
    print("\n".join(format_record(record, name)))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"gpu": name, **record}, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
