"""The timing harness: one MoE layer problem on the GPU, every registered variant timed the same way.

How a point (model, batch, variant) is measured:

1. Routing: every timed sample draws a fresh routing for every weight copy (``kernels.routing.make_routing``, seeded
   by ``(seed, sample, copy)``), as the layers of a decode step route independently: one draw is a property of that
   draw (at qwen3-30b T = 4 one uniform draw touches 25 experts where 29.1 are expected), not of the point. The
   draws are the same for every variant measured on the workbench, so variants are compared on identical routings.
   The bytes a point divides by are the mean over the timed draws (``bytes["unique_experts"]``, with its min / max).
   Draw 0 of the check copy is ``make_routing(..., seed)`` itself: the checks run on it.
2. Weights: generated on the GPU (``kernels.problem.make_weights``) into a *pool* of ``copies`` full copies of the
   ``E`` experts (fresh draws touch any expert, so copies never share one), ``copies = max(2, ceil(3 * L2 / unique
   weight bytes))`` in the most compact of the weight formats measured, capped by free memory; the JSON records both
   the copies needed and the copies used. Each other format's pool (``weight_formats``: e.g. fp8-block128) is the
   bf16 pool quantized once, so every format's copy ``c`` holds the same experts.
3. ``variant.make(dims)`` compiles (fresh every run: nothing is cached here across runs, so an edited
   ``CudaSource.code`` is recompiled by ``kernels.compile``); ``prepack`` runs once per copy; every copy is
   launched once eagerly (JIT compile, first touch), outside the timing.
4. Pre-check: ``out`` poisoned with NaN, one eager launch, compared with the reference. A wrong variant is
   reported and never timed.
5. One CUDA graph is captured on a non-default stream holding a decode step's worth of layer calls (the
   model's MoE layer count, at least one per copy) cycling through the copies, as a serving engine's decode
   graph chains its layers; each copy reads its own routing buffers. Before each sample (outside the events) the
   sample's draws are copied into those buffers; the sample is CUDA events around ``inner`` replays (sized so a
   sample lasts ~``TARGET_SAMPLE_US``), divided by the layer calls: microseconds per layer. The median and spread
   are over the samples, i.e. over fresh routings.
6. Post-check: draw 0 restored, ``out`` poisoned again, the timed graph replayed (its last call uses the check
   copy), compared with ``kernels.reference.moe_decode`` in the variant's mode on a compact host copy of THAT copy's
   touched experts (a captured fallback or an empty graph fails), and its error against the fp64 oracle.
   A launch may name its own numerics (``launch.reference_mode`` / ``launch.quant``, as auto-dispatch does
   for the path it chose: :func:`checked_as`); the row then records those, and the launch's ``facts["choice"]`` /
   ``facts["choice_source"]`` when it states them (keys ``choice`` / ``choice_source``).
7. Per-stage times when the launch has ``stages``, on draw 0 (a stage timed alone reads what the stages before it
   wrote on the previous call, which must belong to the same routing).
"""

from __future__ import annotations

import importlib.metadata
import math
import platform
import statistics
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import numpy as np

from kernels.contract import BF16, Dims
from kernels.routing import make_routing
from kernels.shapes import BF16_BYTES, MoEShape
from tools.gpu import capture, gpu_available

L2_FACTOR = 3  # the bytes the timed replays read must cover >= 3x the L2
TARGET_SAMPLE_US = 2000.0  # one sample's replays last about this long
MEMORY_RESERVE = 2 << 30  # leave this much device memory free besides the pool
CHECK_HOST_BYTES = 1 << 30  # at most this many weight bytes copied to the host per check
CHUNK_BYTES = 512 << 20  # weights are generated in chunks of about this size (generation needs ~5x temp)


# ------------------------------------------------------------------------------------------------
# Pure helpers (no GPU)
# ------------------------------------------------------------------------------------------------
def bytes_breakdown(shape: MoEShape, topk_ids: np.ndarray, weight_format: Any = "bf16") -> dict[str, Any]:
    """What one layer call must move for this routing; TB/s in the report divides ``weights`` by time.

    ``topk_ids``: one draw [T, K], or several [D, T, K] (the mean over them: ``unique_experts`` is then the mean
    touched experts, ``unique_experts_min`` / ``_max`` its range, ``routing_draws`` D).
    ``weights``: the touched experts' bytes in ``weight_format`` (values and scales: what the kernels read)."""
    from kernels.formats import get_format

    fmt = get_format(weight_format)
    ids = np.asarray(topk_ids)
    draws = ids.reshape((-1, *ids.shape[-2:])) if ids.ndim == 3 else ids[None]
    tokens, top_k = (int(d) for d in draws.shape[1:])
    counts = [int(np.unique(draw).size) for draw in draws]
    unique: float = counts[0] if len(counts) == 1 else float(np.mean(counts))
    record = {
        "unique_experts": unique,
        "unique_experts_min": min(counts),
        "unique_experts_max": max(counts),
        "routing_draws": len(counts),
        "expected_unique_uniform": shape.expected_unique_experts(tokens),
        "weight_format": fmt.name,
        "weights": unique * fmt.expert_bytes(shape.hidden, shape.intermediate),
        "activation": tokens * shape.hidden * BF16_BYTES,
        "intermediate": 2 * tokens * top_k * shape.intermediate * BF16_BYTES,
        "output": tokens * shape.hidden * BF16_BYTES,
    }
    record["total"] = record["weights"] + record["activation"] + record["intermediate"] + record["output"]
    record["divisor"] = "weights"
    return record


def draw_seed(seed: int, sample: int, copy: int) -> int:
    """The routing seed of (sample, copy) for a workbench seeded ``seed``: independent streams per pair."""
    return int(np.random.SeedSequence([seed, sample, copy, 0x5EED]).generate_state(1)[0])


def summarize(samples: list[float]) -> dict[str, float]:
    """median / min / max / quartiles / IQR of a list of microsecond samples."""
    if not samples:
        raise ValueError("summarize needs at least one sample")
    ordered = sorted(samples)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {
        "median_us": statistics.median(ordered),
        "min_us": ordered[0],
        "max_us": ordered[-1],
        "q1_us": q1,
        "q3_us": q3,
        "iqr_us": q3 - q1,
    }


def copies_needed(unique_weight_bytes: int, l2_bytes: int) -> int:
    """``max(2, ceil(3 * L2 / unique weight bytes per call))``."""
    return max(2, math.ceil(L2_FACTOR * l2_bytes / max(1, unique_weight_bytes)))


def check_tokens(topk_ids: np.ndarray, expert_bytes: int, limit: int = CHECK_HOST_BYTES, seed: int = 0) -> np.ndarray:
    """Tokens whose outputs are compared with the reference: all of them if their experts fit ``limit``
    bytes on the host, else first, last and a seeded spread of others while they fit (at least one)."""
    ids = np.asarray(topk_ids)
    tokens = ids.shape[0]
    if np.unique(ids).size * expert_bytes <= limit:
        return np.arange(tokens)
    rest = np.random.default_rng(seed).permutation(np.arange(1, tokens - 1)) if tokens > 2 else np.array([], int)
    order = [0] + ([tokens - 1] if tokens > 1 else []) + rest.tolist()
    chosen: list[int] = []
    touched: set[int] = set()
    for token in order:
        union = touched | set(ids[token].tolist())
        if chosen and len(union) * expert_bytes > limit:
            continue
        chosen.append(token)
        touched = union
    return np.array(sorted(chosen))


def compare(result: np.ndarray, reference: np.ndarray, quant: str | None,
            weight_format: str = "bf16") -> dict[str, Any]:
    """Result vs the variant's reference mode under the bench's tolerance (``kernels.checks.BENCH``; ``BENCH_QUANT``
    for FP8-quantized activations, ``BENCH_W8A8`` for those on quantized weights): all written, rel-L2, max ulps, ok.
    A NaN poison left anywhere in ``result`` (an element the timed graph never wrote) fails. Looser than the kernels'
    own tests: this check exists to catch a wrong or empty timed graph."""
    from kernels.checks import BENCH, BENCH_QUANT, BENCH_W8A8, check_output

    tolerance = (BENCH_W8A8 if weight_format != "bf16" else BENCH_QUANT) if quant else BENCH
    return check_output(result, reference, tolerance)


def checked_as(variant: Any, launch: Any) -> Any:
    """What a launch's output is checked against: ``variant`` itself, or -- when the launch states its own
    ``reference_mode`` and/or ``quant`` (auto-dispatch: the numerics of the path it chose for these dims) --
    an object with those two attributes, each taken from the launch when it states it, else from the variant."""
    mode, quant = getattr(launch, "reference_mode", None), getattr(launch, "quant", None)
    if mode is None and quant is None:
        return variant
    return SimpleNamespace(reference_mode=mode or variant.reference_mode, quant=quant or variant.quant,
                           weight_format=getattr(variant, "weight_format", "bf16"))


# ------------------------------------------------------------------------------------------------
# The environment header (GPU presence is tools.gpu's gpu_available, which the programs call as harness's)
# ------------------------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cupy_dist() -> str | None:
    for name in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        if _version(name):
            return name
    return None


def environment(gpu: bool) -> dict[str, Any]:
    """The JSON header: date (UTC ISO), host, package versions and, with a GPU, the device's properties."""
    cupy_dist = _cupy_dist()
    env: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "host": platform.node(),
        "numpy": np.__version__,
        "cupy": _version(cupy_dist) if cupy_dist else None,
        "cupy_dist": cupy_dist,
        "numba": _version("numba"),  # metadata only: importing numba here would fix CUDASIM too early
        "numba_cuda": _version("numba-cuda"),
        "rich": _version("rich"),
        "gpu": None,
    }
    if not gpu:
        return env
    import cupy

    runtime = cupy.cuda.runtime
    device = cupy.cuda.Device().id
    props = runtime.getDeviceProperties(device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])

    def attribute(prop: str, attr: str) -> int | None:
        # CUDA 13 removed clockRate / memoryClockRate from cudaDeviceProp: fall back to the attribute
        if prop in props:
            return int(props[prop])
        try:
            return int(runtime.deviceGetAttribute(getattr(runtime, attr), device))
        except Exception:  # noqa: BLE001
            return None

    sm_khz = attribute("clockRate", "cudaDevAttrClockRate")
    mem_khz = attribute("memoryClockRate", "cudaDevAttrMemoryClockRate")
    env["gpu"] = {
        "name": name,
        "device": device,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "sms": int(props["multiProcessorCount"]),
        "l2_bytes": int(props["l2CacheSize"]),
        "memory_bytes": int(props["totalGlobalMem"]),
        "sm_clock_mhz": sm_khz / 1000 if sm_khz else None,
        "memory_clock_mhz": mem_khz / 1000 if mem_khz else None,
        "memory_bus_bits": attribute("memoryBusWidth", "cudaDevAttrGlobalMemoryBusWidth"),
        "driver": runtime.driverGetVersion(),
        "cuda_runtime": runtime.runtimeGetVersion(),
    }
    return env


# ------------------------------------------------------------------------------------------------
# One problem on the GPU
# ------------------------------------------------------------------------------------------------
def _host(arr: Any) -> np.ndarray:
    return arr.get() if hasattr(arr, "get") else np.asarray(arr)


def _nan_fill(out: Any) -> None:
    import cupy

    if out.dtype == BF16:
        out.view(cupy.uint16).fill(0x7FC0)
    else:
        out.fill(float("nan"))


@dataclass
class Workbench:
    """The inputs of one (model, batch, routing, seed) on the GPU, shared by every variant measured on it."""

    shape: MoEShape
    tokens: int
    routing: str = "uniform"
    seed: int = 0
    l2_bytes: int = 0
    copies_cap: int | None = None  # force fewer copies (tests); None: as needed, memory permitting
    weight_formats: tuple[str, ...] = ("bf16",)  # the formats of the variants it will measure (kernels.formats)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        import cupy

        from kernels.formats import FormatDimsError, get_format

        shape, tokens = self.shape, self.tokens
        formats = [get_format(name) for name in self.weight_formats]
        self.skipped_formats: dict[str, str] = {}  # formats that cannot store this shape: their variants unsupported
        for fmt in formats:
            try:
                fmt.check_dims(shape.hidden, shape.intermediate)
            except FormatDimsError as exc:
                self.skipped_formats[fmt.name] = str(exc)
        self.weight_formats = tuple(dict.fromkeys(["bf16", *(fmt.name for fmt in formats
                                                              if fmt.name not in self.skipped_formats)]))
        ids, weights = make_routing(tokens, shape.experts, shape.top_k, self.routing, self.seed)
        rng = np.random.default_rng([self.seed, 0])
        x = (rng.standard_normal((tokens, shape.hidden), dtype=np.float32)).astype(BF16)
        self.host = {"x": x, "topk_ids": ids, "topk_weights": weights}  # draw 0 of the check copy
        if not self.l2_bytes:
            self.l2_bytes = int(cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"])
        expected = {"uniform": shape.expected_unique_experts(tokens)}.get(self.routing, np.unique(ids).size)
        compact = min(expected * get_format(name).expert_bytes(shape.hidden, shape.intermediate)
                      for name in self.weight_formats)
        needed = copies_needed(int(compact), self.l2_bytes)  # the most compact format still rotates past 3x L2
        per_expert = sum(get_format(name).expert_bytes(shape.hidden, shape.intermediate)
                         for name in self.weight_formats)
        free, _ = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        free += pool.total_bytes() - pool.used_bytes()
        copies = needed if self.copies_cap is None else max(1, min(needed, self.copies_cap))
        while copies > 1 and copies * shape.experts * per_expert + MEMORY_RESERVE > free:
            copies -= 1
        self.copies, self.pool_experts = copies, copies * shape.experts
        self.info = {
            "copies": copies,
            "copies_needed": needed,
            "pool_experts": self.pool_experts,
            "pool_bytes": self.pool_experts * per_expert,
            "weight_formats": list(self.weight_formats),
            **({"weight_formats_skipped": dict(self.skipped_formats)} if self.skipped_formats else {}),
            "rotated_weight_bytes": int(copies * compact),
            "l2_bytes": self.l2_bytes,
            "footprint_ok": copies * compact >= L2_FACTOR * self.l2_bytes,
            "routing_per_copy": "a fresh draw per sample and copy",
        }
        self.w13_pool, self.w2_pool = self._generate(self.pool_experts)
        self.pools: dict[str, tuple[Any, Any]] = {"bf16": (self.w13_pool, self.w2_pool)}
        for name in self.weight_formats[1:]:  # quantized once from the bf16 pool: the same experts in every format
            self.pools[name] = get_format(name).quantize(self.w13_pool, self.w2_pool)
        self.x = cupy.asarray(x)
        # each copy's routing buffers, one [copies, T, K] array: a sample's draws are one copy into them
        self.ids_buffers = cupy.empty((copies, tokens, shape.top_k), dtype=np.int32)
        self.weights_buffers = cupy.empty((copies, tokens, shape.top_k), dtype=np.float32)
        self._draws: list[tuple[np.ndarray, np.ndarray]] = []  # host draws per sample: ([C, T, K], [C, T, K])
        self._device_draws: list[tuple[Any, Any]] = []
        self.check_copy = copies - 1  # the last copy: a wrong base pointer shows here
        self._load_draw(0)
        self.topk_ids, self.topk_weights = self.ids_buffers[self.check_copy], self.weights_buffers[self.check_copy]
        cupy.cuda.Device().synchronize()  # generation and copies ran on the legacy stream; timing uses another
        self.layers_per_graph = shape.layers
        self.info["layers_per_graph"] = shape.layers
        self.dims = Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        self.check_token_ids = check_tokens(ids, shape.expert_bytes, seed=self.seed)
        self._compact: dict[int, dict[str, Any]] = {}
        self._references: dict[tuple[str, str | None], np.ndarray] = {}
        self._last: list[Any] = []  # the replays of the variant being measured (for the post-check)

    # -- routing draws --------------------------------------------------------------------------
    def draw(self, sample: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``sample``'s host routing for every copy: ``(ids [C, T, K], weights [C, T, K])``; draw 0 of the
        check copy is the workbench's own (``host``), every other (sample, copy) its own seeded draw."""
        shape = self.shape
        while len(self._draws) <= sample:
            index = len(self._draws)
            pairs = [(self.host["topk_ids"], self.host["topk_weights"]) if (index, c) == (0, self.check_copy) else
                     make_routing(self.tokens, shape.experts, shape.top_k, self.routing, draw_seed(self.seed, index, c))
                     for c in range(self.copies)]
            self._draws.append((np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])))
        return self._draws[sample]

    def draw_bytes(self, samples: int, weight_format: str = "bf16") -> dict[str, Any]:
        """The bytes of a point timed over samples ``0 .. samples-1``: mean touched experts over their draws."""
        ids = np.stack([self.draw(s)[0] for s in range(max(1, samples))])
        return bytes_breakdown(self.shape, ids.reshape(-1, *ids.shape[-2:]), weight_format)

    def _load_draw(self, sample: int, stream: Any = None) -> None:
        """Copy sample ``sample``'s draws into the copies' routing buffers (on ``stream``, ordered before what
        follows on it; device copies of the draws are kept, so this is one device-to-device copy per array)."""
        import cupy

        while len(self._device_draws) <= sample:
            ids, weights = self.draw(len(self._device_draws))
            self._device_draws.append((cupy.asarray(ids), cupy.asarray(weights)))
        ids, weights = self._device_draws[sample]
        if stream is None:
            self.ids_buffers[...] = ids
            self.weights_buffers[...] = weights
            return
        with stream:
            self.ids_buffers[...] = ids
            self.weights_buffers[...] = weights

    # -- weights --------------------------------------------------------------------------------
    def _generate(self, pool_experts: int) -> tuple[Any, Any]:
        import cupy

        from kernels.problem import make_weights

        shape = self.shape
        H, I = shape.hidden, shape.intermediate
        w13 = cupy.empty((pool_experts, 2 * I, H), dtype=BF16)
        w2 = cupy.empty((pool_experts, H, I), dtype=BF16)
        chunk = max(1, CHUNK_BYTES // shape.expert_bytes)
        for index, start in enumerate(range(0, pool_experts, chunk)):
            stop = min(pool_experts, start + chunk)
            a, b = make_weights(shape.with_(experts=stop - start), seed=self.seed * 100_003 + index, xp=cupy)
            w13.view(cupy.uint16)[start:stop] = a.view(cupy.uint16)  # raw bits: no bf16 arithmetic needed
            w2.view(cupy.uint16)[start:stop] = b.view(cupy.uint16)
            del a, b
        cupy.get_default_memory_pool().free_all_blocks()
        return w13, w2

    def weights(self, copy: int, weight_format: str = "bf16") -> tuple[Any, Any]:
        """Copy ``copy``'s ``(w13, w2)`` in ``weight_format`` (one of ``weight_formats``): contiguous [E, ...] views
        into that format's pool (a scaled format: a :class:`kernels.formats.Quantized` of views: values, scales and
        a per-expert global scale, each [E, ...] of the copy)."""
        from kernels.problem import convert_array

        if weight_format not in self.pools:
            raise ValueError(f"weight_format {weight_format!r} has no pool here; this workbench holds "
                             f"{', '.join(self.pools)} (its weight_formats)")
        start = copy * self.shape.experts
        stop = start + self.shape.experts
        w13, w2 = self.pools[weight_format]
        return convert_array(w13, lambda a: a[start:stop]), convert_array(w2, lambda a: a[start:stop])

    # -- reference ------------------------------------------------------------------------------
    def _compact_copy(self, copy: int, weight_format: str = "bf16") -> dict[str, Any]:
        """Host arrays of the checked tokens with only the experts they touch in copy ``copy`` (in
        ``weight_format``: its values as the host reads them, and its scales)."""
        import cupy

        from kernels.problem import convert_array

        key = (copy, weight_format)
        if key not in self._compact:
            tokens = self.check_token_ids
            ids = self.host["topk_ids"][tokens]
            touched, remapped = np.unique(ids, return_inverse=True)
            rows = copy * self.shape.experts + touched
            index = cupy.asarray(rows.astype(np.int64))

            def touched_on_host(a: Any) -> np.ndarray:  # the touched experts' rows of one array of a weight
                if a.dtype.itemsize == 1:  # fp8's e4m3 bytes (the reference reads them as such), packed e2m1, scales
                    return _host(a.view(cupy.uint8)[index])
                if a.dtype.itemsize == 2:  # bf16: CuPy moves it as its bit patterns
                    return _host(a.view(cupy.uint16)[index]).view(BF16)
                return _host(a[index])  # float32 scales and global scales

            w13, w2 = self.pools[weight_format]
            self._compact[key] = {
                "x": self.host["x"][tokens], "w13": convert_array(w13, touched_on_host),
                "w2": convert_array(w2, touched_on_host),
                "topk_ids": remapped.reshape(ids.shape).astype(np.int32),
                "topk_weights": self.host["topk_weights"][tokens],
            }
        return self._compact[key]

    def reference(self, mode: str, quant: str | None = None, weight_format: str = "bf16") -> np.ndarray:
        """``kernels.reference.moe_decode`` on the check copy's checked tokens, weights in ``weight_format``
        (cached per mode and format)."""
        key = (mode, quant, weight_format)
        if key not in self._references:
            from kernels.reference import moe_decode

            c = self._compact_copy(self.check_copy, weight_format)
            self._references[key] = moe_decode(
                c["x"], c["w13"], c["w2"], c["topk_ids"], c["topk_weights"], mode=mode, quant=quant,
                weight_format=weight_format,
            )
        return self._references[key]

    def check_output(self, out_host: np.ndarray, variant: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(check vs the variant's reference mode, error vs fp64)`` of a [T, H] output from the check copy; both
        on the weights in the variant's format (fp64: the oracle on those weights, dequantized)."""
        from kernels.numerics import max_abs, rel_l2

        fmt = getattr(variant, "weight_format", "bf16")
        tokens = self.check_token_ids
        written = bool(np.isfinite(out_host.astype(np.float32)).all())
        result = out_host[tokens]
        check = compare(result, self.reference(variant.reference_mode, variant.quant, fmt), variant.quant, fmt)
        check.update(mode=variant.reference_mode, quant=variant.quant, copy=self.check_copy,
                     tokens_checked=int(tokens.size), all_written=written and check["all_written"])
        check["ok"] = bool(check["ok"] and written)
        if check["all_written"]:
            oracle = self.reference("fp64", None, fmt)
            values = result.astype(np.float32).astype(np.float64)
            error = {"rel_l2": rel_l2(values, oracle), "max_abs": max_abs(values, oracle)}
        else:
            error = {"rel_l2": None, "max_abs": None}
        return check, error

    def _bytes_in(self, weight_format: str, samples: int = 1) -> dict[str, Any]:
        """This problem's bytes over the draws of samples ``0 .. samples-1``, weights counted in ``weight_format``."""
        return self.draw_bytes(samples, weight_format)

    def free(self) -> None:
        import cupy

        self.w13_pool = self.w2_pool = None
        self.pools.clear()
        self._compact.clear()
        cupy.get_default_memory_pool().free_all_blocks()

    # -- one variant ----------------------------------------------------------------------------
    def measure(self, variant: Any, repeats: int = 30, params: dict[str, Any] | None = None,
                stages: bool = True, on_step: Any = None) -> dict[str, Any]:
        """Compile, check, time and re-check one variant (with ``params`` overriding its knobs); ``on_step(what)``
        is told each phase as it starts (progress)."""
        import cupy

        def step(what: str) -> None:
            if on_step is not None:
                on_step(what)

        record: dict[str, Any] = {
            "variant": variant.name, "backend": variant.backend, "family": variant.family,
            "baseline": bool(variant.baseline), "params": {**variant.params, **(params or {})},
            "reference_mode": variant.reference_mode, "quant": variant.quant,
            "batch": self.tokens, "model": self.shape.name, "routing": self.routing, "seed": self.seed,
            "bytes": self._bytes_in(getattr(variant, "weight_format", "bf16"), repeats),
            "copies": self.info["copies"], "rotation": dict(self.info),
            "status": "error", "error": None, "samples_us": [], "stages": [],
        }
        skipped = self.skipped_formats.get(getattr(variant, "weight_format", "bf16"))
        if skipped is not None:
            record.update(status="unsupported", error=f"{variant.name}: {skipped}")
            return record
        if not variant.can_run(self.dims, **(params or {})):
            record.update(status="unsupported", error=f"{variant.name} cannot run {self.dims} (its supports())")
            return record
        stream = cupy.cuda.Stream(non_blocking=True)
        try:
            started = time.perf_counter()
            step("compiling")
            launch = variant.make(self.dims, **(params or {}))
            checked = checked_as(variant, launch)
            record.update(reference_mode=checked.reference_mode, quant=checked.quant)
            facts = getattr(launch, "facts", {})
            if "choice" in facts:
                record.update(choice=facts["choice"], choice_source=facts.get("choice_source"))
            copies = []
            for c in range(self.copies):
                w13, w2 = self.weights(c, getattr(variant, "weight_format", "bf16"))
                if variant.prepack is not None:
                    w13, w2 = variant.prepack(w13, w2)
                copies.append((w13, w2))
            out = cupy.empty((self.tokens, self.shape.hidden), dtype=BF16)
            args = [(self.x, w13, w2, self.ids_buffers[c], self.weights_buffers[c], out)
                    for c, (w13, w2) in enumerate(copies)]
            self._load_draw(0, stream)  # the checks' draw (an earlier variant's timing left its last one)
            with stream:
                for a in args:  # JIT compile and first touch, outside the timing
                    launch(*a)
            stream.synchronize()
            record["build_s"] = time.perf_counter() - started

            # pre-check: an eager launch of the check copy; a wrong variant is never timed
            step("checking against the reference")
            with stream:  # the poison on the timing stream: a non-blocking stream does not wait for the legacy one
                _nan_fill(out)
                launch(*args[self.check_copy])
            stream.synchronize()
            check, _ = self.check_output(_host(out), checked)
            record["precheck"] = check
            if not check["ok"]:
                record.update(status="wrong", check=check,
                              error=f"eager output disagrees with reference mode {checked.reference_mode!r}")
                return record

            fns = [lambda a=a: launch(*a) for a in args]
            step(f"timing ({repeats} samples of CUDA-graph replays)")
            samples, mode, why = self._time(stream, fns, repeats, resample=True)
            record.update(samples_us=samples, timing_mode=mode, capture_error=why, **summarize(samples))
            record["samples_unique_experts"] = [float(np.mean([np.unique(d).size for d in self.draw(s)[0]]))
                                                for s in range(len(samples))]
            record["tbps"] = record["bytes"]["weights"] / (record["median_us"] * 1e-6) / 1e12

            # post-check: replay the TIMED graph (or launch) of the check copy into a poisoned out, on draw 0
            step("re-checking the timed graph's output")
            self._load_draw(0, stream)
            with stream:
                _nan_fill(out)
                self._last[0]()  # the timed graph: its last layer call uses the check copy
            stream.synchronize()
            check, error = self.check_output(_host(out), checked)
            record.update(check=check, error_vs_fp64=error)
            record["status"] = "ok" if check["ok"] else "wrong"
            if not check["ok"]:
                record["error"] = "the timed graph's output disagrees with the reference"

            if stages and getattr(launch, "stages", None) is not None:
                step("timing each stage")
                record["stages"] = self._time_stages(stream, launch, args, max(5, repeats // 2))
        except Exception as exc:  # noqa: BLE001 - one broken variant must not stop the bench
            record.update(status="error", error=f"{type(exc).__name__}: {exc}")
            try:
                stream.synchronize()
            except Exception:  # noqa: BLE001
                pass
        finally:
            self._last = []
        return record

    def _time(self, stream: Any, fns: list[Any], repeats: int,
              resample: bool = False) -> tuple[list[float], str, str | None]:
        """Per-layer microseconds of ``fns`` (one per weight copy), captured as one decode-step graph.

        The graph holds ``layers_per_graph`` layer calls cycling through the copies and ending on the check
        copy (the last), as a model's decode step chains its MoE layers; a sample is CUDA events around
        replays of that graph, divided by the layer calls it ran. Launch gaps inside a graph are counted,
        the host's graph-launch cost is amortised as it is in serving. Without capture, eager launches.
        ``resample``: sample ``i`` runs on draw ``i`` (copied into the routing buffers before its events).
        """
        import cupy

        n = len(fns)
        calls = n * max(1, math.ceil(self.layers_per_graph / n))
        why = None
        try:
            sequence = [fns[i % n] for i in range(calls)]
            graph = capture(stream, lambda: [fn() for fn in sequence])
            replays = [lambda: graph.launch(stream)]
            mode = "graph"
        except Exception as exc:  # noqa: BLE001 - not capturable: time eager launches, say so
            why = f"{type(exc).__name__}: {exc}"
            replays, mode, calls = [lambda: [fn() for fn in fns]], "eager", n
        self._last = replays
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()

        def sample(inner: int, draw: int | None = None) -> float:
            if draw is not None:
                self._load_draw(draw, stream)
            with stream:
                start.record(stream)
                for _ in range(inner):
                    replays[0]()
                stop.record(stream)
            stop.synchronize()
            return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / (inner * calls)

        estimate = min(sample(1) for _ in range(3))  # also the warm-up of the graph
        inner = max(1, min(50, math.ceil(TARGET_SAMPLE_US / max(estimate * calls, 1e-3))))
        return [sample(inner, i if resample else None) for i in range(repeats)], mode, why

    def _time_stages(self, stream: Any, launch: Any, args: list[tuple], repeats: int) -> list[dict[str, Any]]:
        """Each stage timed alone (a graph of that stage's calls), and -- with two or more stages -- what it costs
        inside the layer's chain: the whole layer's median minus the median of the layer with that stage left out,
        both timed here. A short stage alone shows its launch gap; in the chain it also holds its neighbours (PDL
        waits, a kernel boundary), which ``in_chain_us`` counts. Leaving a stage out keeps the outputs it wrote on
        the previous call in the workspace (the same routing: the later stages do the same work); timing only."""
        per_copy = [launch.stages(*a) for a in args]
        out = []
        for index, (name, _) in enumerate(per_copy[0]):
            fns = [stages[index][1] for stages in per_copy]
            try:
                samples, mode, why = self._time(stream, fns, repeats)
                out.append({"name": name, "samples_us": samples, "timing_mode": mode, **summarize(samples)})
            except Exception as exc:  # noqa: BLE001
                out.append({"name": name, "error": f"{type(exc).__name__}: {exc}", "samples_us": []})
        if len(per_copy[0]) > 1:
            try:
                self._time_in_chain(stream, per_copy, repeats, out)
            except Exception as exc:  # noqa: BLE001 - the stages alone stand without it
                for entry in out:
                    entry["in_chain_error"] = f"{type(exc).__name__}: {exc}"
        self._last = []
        return out

    def _time_in_chain(self, stream: Any, per_copy: list[list[tuple[str, Any]]], repeats: int,
                       out: list[dict[str, Any]]) -> None:
        """Adds ``layer_us``, ``without_us`` and ``in_chain_us`` (their difference) to each stage's entry."""
        def layer(stages: list[tuple[str, Any]], skip: int) -> Any:
            return lambda: [fn() for j, (_, fn) in enumerate(stages) if j != skip]

        whole, _, _ = self._time(stream, [layer(stages, -1) for stages in per_copy], repeats)
        layer_us = statistics.median(whole)
        for index, entry in enumerate(out):
            without, _, _ = self._time(stream, [layer(stages, index) for stages in per_copy], repeats)
            entry.update(layer_us=layer_us, without_us=statistics.median(without),
                         in_chain_us=layer_us - statistics.median(without))


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.harness``: what the harness sees here (GPU or why not, package versions), as JSON."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m tools.harness",
                                     description="Print what the timing harness sees on this machine: the GPU (or "
                                                 "why there is none) and the package versions, as JSON. The harness "
                                                 "itself is used through python -m tools.bench and tools.sweep.")
    parser.parse_args(argv)
    gpu, why = gpu_available()
    print(json.dumps({"gpu_available": gpu, "reason": why, **environment(gpu)}, indent=1))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
