"""The one place CUDA C sources are compiled and cached.

A :class:`CudaSource` is CUDA C text whose knobs are preprocessor macros (``WARPS``, ``UNROLL``, ...); a kernel
family (:mod:`kernels.family`) wraps one with its knob rules, workspace and stages. This layer knows no knob.
``get_kernel(source, "name", WARPS=8)`` compiles that combination once through CuPy's ``RawModule`` (NVRTC),
keeps the module in memory, and CuPy keeps the cubin on disk (``$CUPY_CACHE_DIR``, default
``~/.cupy/kernel_cache``; delete that folder to clear it).

``offline_report(source, **defines)`` compiles the same text for sm_90 with NVRTC directly
(``cuda.bindings.nvrtc``) -- no driver, no GPU -- and parses ptxas' resource report (registers, shared
memory, stack frame, spill bytes); the report is kept in memory by the rendered text, so a text is compiled
once per process however many callers ask. With ``$WD_OFFLINE_REPORT_CACHE`` naming a folder the reports are also
kept there, one file per text (keyed by its hash, the arch, the options and NVRTC's version), so processes sharing
the folder compile a text once between them: the test suite points its workers and the tools it starts at one
folder for the run. ``ptx_report(ptx)`` does the same for PTX from other front ends
(Numba) through nvJitLink. Sources are registered in :data:`SOURCES` (a kernel family does it) so
``tools.compile_report`` finds them.

Edit-and-rerun from IPython: change ``source.code`` (or build a new ``CudaSource``) and call
``get_kernel`` again -- the cache key is the text itself, so the edited kernel is compiled afresh.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

DEFAULT_ARCH = "sm_90"
# -ftz=true: CuPy adds it to every NVRTC compile (cupy/cuda/compiler.py), after the caller's options, so the GPU's code
# flushes FP32 subnormals (inputs and results) to zero. Naming it here makes the offline compile (reports, machine-code
# hashes) the code the GPU runs; the kernels must not rely on an FP32 subnormal (the 4-bit widening keeps its one in
# bf16x2: kernels/batched/loaders_fp4.py). The g++ emulation flushes as the GPU does (tests/warp_checks.py: EmuFtz);
# the NumPy references keep subnormals.
NVRTC_OPTIONS = ("-std=c++17", "-ftz=true")


@dataclass
class CudaSource:
    """CUDA C text with compile-time knobs. ``defaults`` are the macros a call does not override."""

    name: str
    code: str
    kernels: tuple[str, ...]
    defaults: dict[str, int] = field(default_factory=dict)
    # parameter sets the offline report compiles besides the defaults (e.g. the tuned presets)
    variants: list[dict[str, int]] = field(default_factory=list)
    description: str = ""
    # kernel -> the knob holding its warps per block (tools.compile_report's occupancy needs the block size)
    warps_knobs: dict[str, str] = field(default_factory=dict)
    # kernel -> the knob that must be non-zero for the text to define it (opt-in kernels behind an #if)
    conditional_kernels: dict[str, str] = field(default_factory=dict)
    # kernel -> the prefix of the knobs that only its code reads (GATE_UP: "GU_"), where the source keeps its kernels'
    # knobs apart: tools.compile_report labels a kernel's row without the other kernels' prefixed knobs
    knob_prefixes: dict[str, str] = field(default_factory=dict)
    # kernel -> (bytes, why): a spill measured and kept; spill stores, spill loads and stack frame each within the
    # bytes are shown as accepted, with the reason, by tools.compile_report (every other spill is a finding)
    accepted_spills: dict[str, tuple[int, str]] = field(default_factory=dict)

    def render(self, **defines: int) -> str:
        """The full text NVRTC sees: ``#define`` lines for every knob, then the code."""
        unknown = set(defines) - set(self.defaults)
        if unknown:
            raise ValueError(
                f"{self.name}: unknown compile-time parameter(s) {sorted(unknown)}; known: {sorted(self.defaults)}"
            )
        values = {**self.defaults, **defines}
        lines = [f"#define {key} {int(value)}" for key, value in sorted(values.items())]
        return "\n".join(lines) + "\n" + self.code

    def params(self, **defines: int) -> dict[str, int]:
        return {**self.defaults, **defines}

    def compiled_kernels(self, **defines: int) -> tuple[str, ...]:
        """The kernels the text defines with these knobs (every kernel but the opt-in ones left off)."""
        values = self.params(**defines)
        return tuple(k for k in self.kernels
                     if k not in self.conditional_kernels or values.get(self.conditional_kernels[k]))


SOURCES: dict[str, CudaSource] = {}


def validate_knobs(what: str, params: dict[str, Any], defaults: dict[str, int], limits: dict[str, tuple[int, int]],
                   auto_knobs: tuple[str, ...] = ()) -> dict[str, int]:
    """``defaults`` (with every auto knob at 0, "auto") updated by ``params``, each value an int within ``limits``.
    ValueError names an unknown knob (``what``: whose knobs) or one out of range; TypeError a value that is not an
    int. The one knob check of the CUDA sources' ``resolve_params``."""
    unknown = set(params) - set(defaults)
    if unknown:
        raise ValueError(f"unknown {what} parameter(s) {sorted(unknown)}; known: {sorted(defaults)}")
    values: dict[str, int] = {**defaults, **{knob: 0 for knob in auto_knobs}}
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{key} must be an int, got {value!r}")
        values[key] = int(value)
    for key, (low, high) in limits.items():
        if not low <= values[key] <= high:
            raise ValueError(f"{key} must be in {low}..{high}{' (0 = auto)' if key in auto_knobs else ''}, "
                             f"got {values[key]}")
    return values


def preset_variants(resolve: Any, defaults: dict[str, int], tokens: tuple[int, ...] = (1, 3, 8, 64)) -> list[dict]:
    """The knobs ``resolve(dims)`` picks for every preset at these batches, as overrides of ``defaults``:
    what a source lists in ``variants`` so the offline report compiles what the presets will run."""
    # here, not at the top: kernels.shapes loads ml_dtypes (through kernels.arrays), which the report tools'
    # ``import kernels.compile`` does without; kernels.shapes imports nothing that reaches this module
    from kernels.shapes import PRESETS, Dims

    seen: list[dict[str, int]] = []
    for shape in PRESETS.values():
        for t in tokens:
            try:
                params = resolve(Dims(t, shape.hidden, shape.intermediate, shape.experts, shape.top_k))
            except ValueError:  # a preset these knobs cannot run (a tiled format's odd widths): nothing to compile
                continue
            override = {key: value for key, value in params.items() if defaults.get(key) != value}
            if override and override not in seen:
                seen.append(override)
    return seen


def register_source(source: CudaSource) -> CudaSource:
    """Make ``source`` known to ``tools.compile_report`` (re-registering a name replaces it)."""
    SOURCES[source.name] = source
    return source


# ---------------------------------------------------------------------------------------------------
# On the GPU: CuPy RawModule, cached in memory by the rendered text.
# ---------------------------------------------------------------------------------------------------
_MODULES: dict[tuple[str, str], Any] = {}


def _key(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def get_module(source: CudaSource, **defines: int) -> Any:
    """The compiled ``cupy.RawModule`` for ``source`` with these knobs (compiled on first use)."""
    import cupy

    text = source.render(**defines)
    device = cupy.cuda.Device().id
    key = (_key(text), str(device))
    module = _MODULES.get(key)
    if module is None:
        module = cupy.RawModule(code=text, options=NVRTC_OPTIONS, name_expressions=None)
        module.compile()
        _MODULES[key] = module
    return module


def get_kernel(source: CudaSource, kernel: str, **defines: int) -> Any:
    """One ``cupy.RawKernel`` of ``source`` (see :func:`get_module`)."""
    if kernel not in source.kernels:
        raise ValueError(f"{source.name} has no kernel {kernel!r}; it has {source.kernels}")
    return get_module(source, **defines).get_function(kernel)


def launch_ex(
    kernel: Any,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple[Any, ...],
    *,
    shared_mem: int = 0,
    programmatic: bool = False,
    cooperative: bool = False,
) -> None:
    """Launch a ``cupy.RawKernel`` on CuPy's current stream; the one launch path with launch attributes.

    With ``programmatic=False`` this is ``kernel(grid, block, args)``. With ``programmatic=True`` it goes
    through the driver's ``cuLaunchKernelEx`` with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``
    (programmatic dependent launch, sm_90+): the kernel may start while the previous kernel in the stream
    drains, and must itself execute ``griddepcontrol.wait`` before reading that kernel's output. Works under
    CUDA-graph capture (the edge becomes a programmatic dependency). ``cooperative=True`` adds
    ``CU_LAUNCH_ATTRIBUTE_COOPERATIVE``: the driver refuses the launch unless every block can be resident at once
    (what a kernel with a grid barrier needs). ``args``: CuPy arrays and NumPy scalars.
    """
    if not programmatic and not cooperative:
        kernel(grid, block, args, shared_mem=shared_mem)
        return
    import ctypes

    import cupy
    from cuda.bindings import driver

    values, types = [], []
    for arg in args:
        if hasattr(arg, "data") and hasattr(arg.data, "ptr"):  # a CuPy array: its device pointer
            values.append(int(arg.data.ptr))
            types.append(ctypes.c_void_p)
        elif isinstance(arg, np.int32):
            values.append(int(arg))
            types.append(ctypes.c_int32)
        elif isinstance(arg, np.uint64):
            values.append(int(arg))
            types.append(ctypes.c_uint64)
        elif isinstance(arg, np.float32):
            values.append(float(arg))
            types.append(ctypes.c_float)
        else:
            raise TypeError(f"launch_ex: unsupported kernel argument type {type(arg).__name__}")
    grid3, block3 = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = (int(g) for g in grid3)
    config.blockDimX, config.blockDimY, config.blockDimZ = (int(b) for b in block3)
    config.sharedMemBytes = int(shared_mem)
    config.hStream = driver.CUstream(int(cupy.cuda.get_current_stream().ptr))
    attributes = []
    if programmatic:
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attribute.value.programmaticStreamSerializationAllowed = 1
        attributes.append(attribute)
    if cooperative:
        attribute = driver.CUlaunchAttribute()
        attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        attribute.value.cooperative = 1
        attributes.append(attribute)
    config.attrs = attributes
    config.numAttrs = len(attributes)
    function = driver.CUfunction(int(getattr(kernel, "kernel", kernel).ptr))  # RawKernel -> its CUfunction
    (status,) = driver.cuLaunchKernelEx(config, function, (tuple(values), tuple(types)), 0)
    if int(status) != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: {status}")


def max_active_blocks(kernel: Any, threads: int, shared_mem: int) -> int:
    """Blocks of ``kernel`` (a RawKernel) that fit on one SM at once with ``threads`` threads and ``shared_mem``
    bytes of dynamic shared memory (the driver's occupancy calculator)."""
    from cuda.bindings import driver

    function = driver.CUfunction(int(getattr(kernel, "kernel", kernel).ptr))
    status, blocks = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, int(threads), int(shared_mem))
    if int(status) != 0:
        raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed: {status}")
    return int(blocks)


def device_sm_count(default: int) -> int:
    """Streaming multiprocessors of the current GPU, or ``default`` where no GPU (or no CuPy) is present."""
    try:
        import cupy

        return _sm_count(int(cupy.cuda.Device().id))
    except Exception:  # noqa: BLE001 - no CuPy, no driver or no device: the caller's documented default
        return default


@functools.cache
def _sm_count(device: int) -> int:
    """One attribute query per device (``resolve_params`` may ask on every call)."""
    import cupy

    return int(cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device))


def clear_memory_cache() -> None:
    """Forget compiled modules held in this process (CuPy's disk cache is untouched)."""
    _MODULES.clear()


# ---------------------------------------------------------------------------------------------------
# Offline: NVRTC / nvJitLink for sm_90 with ptxas' resource report, no GPU needed.
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelResources:
    """ptxas' report for one kernel."""

    kernel: str
    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    arch: str = DEFAULT_ARCH

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


class OfflineCompileError(RuntimeError):
    """NVRTC or nvJitLink rejected the source; the message carries the compiler log."""


_PROPS = re.compile(r"Function properties for '?([\w$]+)'?:?")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"[Uu]sed (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_JIT_STACK = re.compile(r"(\d+) stack")
_JIT_LMEM = re.compile(r"(\d+) bytes lmem")


def parse_ptxas_log(log: str, arch: str = DEFAULT_ARCH) -> list[KernelResources]:
    """Parse ``ptxas -v`` (NVRTC) or nvJitLink ``-verbose`` output into one record per kernel."""
    reports: list[KernelResources] = []
    current: dict[str, Any] | None = None
    for line in log.splitlines():
        match = _PROPS.search(line)
        if match:
            if current is not None and "registers" in current:
                reports.append(KernelResources(arch=arch, **current))
            current = {
                "kernel": match.group(1),
                "shared_bytes": 0,
                "stack_bytes": 0,
                "spill_stores": 0,
                "spill_loads": 0,
            }
            jit_regs = _REGS.search(line)  # nvJitLink puts everything on the next line
            if jit_regs:
                current["registers"] = int(jit_regs.group(1))
            continue
        if current is None:
            continue
        stack = _STACK.search(line)
        if stack:
            current["stack_bytes"], current["spill_stores"], current["spill_loads"] = (int(g) for g in stack.groups())
        regs = _REGS.search(line)
        if regs:
            current["registers"] = int(regs.group(1))
            smem = _SMEM.search(line)
            if smem:
                current["shared_bytes"] = int(smem.group(1))
            jit_stack = _JIT_STACK.search(line)
            if jit_stack and "stack frame" not in line:
                current["stack_bytes"] = int(jit_stack.group(1))
            lmem = _JIT_LMEM.search(line)
            if lmem and int(lmem.group(1)):
                current["spill_stores"] = current["spill_loads"] = int(lmem.group(1))
    if current is not None and "registers" in current:
        reports.append(KernelResources(arch=arch, **current))
    return list({report.kernel: report for report in reports}.values())  # one per kernel, last wins


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - installed with numba-cuda[cu12]
        raise OfflineCompileError(
            "cuda.bindings (pip install 'numba-cuda[cu12]') is needed for offline compiles"
        ) from exc
    return nvrtc


def _check(result: Any, what: str, log: str = "") -> None:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise OfflineCompileError(f"{what} failed ({err}):\n{log}")


def offline_compile(text: str, arch: str = DEFAULT_ARCH, name: str = "kernel.cu") -> tuple[bytes, str]:
    """NVRTC ``text`` to a cubin for ``arch`` with ``-Xptxas=-v``; returns ``(cubin, log)``."""
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(text.encode(), name.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        options = [f"-arch={arch}".encode(), b"-Xptxas=-v", *(o.encode() for o in NVRTC_OPTIONS)]
        compiled = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log_text = log.decode(errors="replace").rstrip("\x00 ")
        _check(compiled, f"NVRTC compile of {name}", log_text)
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin, log_text
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# (rendered text, arch) -> its kernels' reports: the same text compiles to the same report, and the test suite, the
# compile report and the sweep ask for many texts more than once (a preset's knobs are also a variant's)
_REPORTS: dict[tuple[str, str], tuple[KernelResources, ...]] = {}


REPORT_CACHE_ENV = "WD_OFFLINE_REPORT_CACHE"


@functools.cache
def _nvrtc_version() -> str:
    err, major, minor = _nvrtc().nvrtcVersion()
    return f"{major}.{minor}" if int(err) == 0 else "unknown"


@contextlib.contextmanager
def _shared_report_file(text: str, arch: str) -> Any:
    """The cache file of ``text`` in ``$WD_OFFLINE_REPORT_CACHE`` (``None`` where that is unset), held under an
    exclusive lock so that a process asking for a text another is compiling waits for its report."""
    folder = os.environ.get(REPORT_CACHE_ENV)
    if not folder:
        yield None
        return
    key = _key("\0".join(("reports-v1", text, arch, *NVRTC_OPTIONS, _nvrtc_version())))
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{key}.json")
    try:
        import fcntl
    except ImportError:  # no flock (Windows): concurrent misses compile twice, the writes stay atomic
        yield path
        return
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield path


def _read_reports(path: str | None) -> tuple[KernelResources, ...] | None:
    if path is None or not os.path.exists(path):
        return None
    with open(path) as f:
        return tuple(KernelResources(**record) for record in json.load(f))


def _write_reports(path: str | None, reports: list[KernelResources]) -> None:
    if path is None:
        return
    partial = f"{path}.{os.getpid()}.{uuid.uuid4().hex}"
    with open(partial, "w") as f:
        json.dump([asdict(report) for report in reports], f)
    os.replace(partial, path)  # readers see the whole file or none


def offline_report(source: CudaSource, arch: str = DEFAULT_ARCH, **defines: int) -> list[KernelResources]:
    """Resource report of every kernel in ``source`` compiled with these knobs for ``arch``; compiled once per
    process (the key is the rendered text, so an edited ``source.code`` is compiled afresh; errors are not kept),
    and once per ``$WD_OFFLINE_REPORT_CACHE`` folder where that is set."""
    text = source.render(**defines)
    cached = _REPORTS.get((text, arch))
    if cached is not None:
        return list(cached)
    with _shared_report_file(text, arch) as path:
        shared = _read_reports(path)
        if shared is not None:
            _REPORTS[text, arch] = shared
            return list(shared)
        reports = _compile_report(source, text, arch)
        _write_reports(path, reports)
    _REPORTS[text, arch] = tuple(reports)
    return reports


def _compile_report(source: CudaSource, text: str, arch: str) -> list[KernelResources]:
    _, log = offline_compile(text, arch, f"{source.name}.cu")
    reports = parse_ptxas_log(log, arch)
    if not reports:
        # Newer NVRTC serves a text it has compiled before from the CUDA compute cache without running ptxas,
        # so `-Xptxas=-v` prints nothing (NVIDIA/cuda-python issue 1124; seen on the H200 image for points an
        # earlier process had compiled). A comment unique to this call was not always enough there (2026-12-01:
        # the H200 image's NVRTC still printed nothing), so the retry also adds an empty kernel with a unique
        # name -- new PTX, a new cache key -- whose own report is dropped.
        marker = f"offline_report_{uuid.uuid4().hex}"
        retry = f'{text}\n// offline report\nextern "C" __global__ void {marker}() {{}}\n'
        _, log = offline_compile(retry, arch, f"{source.name}.cu")
        reports = [r for r in parse_ptxas_log(log, arch) if r.kernel != marker]
    if not reports:
        raise OfflineCompileError(f"no ptxas report found for {source.name}:\n{log}")
    return reports


def ptx_report(ptx: str | bytes, arch: str = DEFAULT_ARCH) -> list[KernelResources]:
    """Assemble PTX (e.g. from ``numba.cuda.compile_ptx``) for ``arch`` with nvJitLink; parse its report."""
    try:
        from cuda.bindings import nvjitlink
    except ImportError as exc:  # pragma: no cover
        raise OfflineCompileError("cuda.bindings with nvJitLink is needed for PTX reports") from exc
    data = ptx.encode() if isinstance(ptx, str) else ptx
    handle = nvjitlink.create(2, [f"-arch={arch}", "-verbose"])
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        try:
            nvjitlink.complete(handle)
        finally:
            size = nvjitlink.get_info_log_size(handle)
            log = bytearray(size)
            nvjitlink.get_info_log(handle, log)
        return parse_ptxas_log(log.decode(errors="replace"), arch)
    finally:
        nvjitlink.destroy(handle)
