"""An emulated CuPy device for tests: the lab's GPU code (``kernels``) runs unchanged on the CPU.

Inside :func:`emulated_device` (a context manager; ``emulated``, the fixture of tests/conftest.py, for one test):

* ``import cupy`` gives :data:`cupy`-like module of NumPy-backed arrays (:class:`ndarray`: 256-byte aligned host
  memory whose address is ``.data.ptr``; ``cupy.empty`` poisons its bytes with 0xFF, NaN in every float format) --
  only what the decode step's path uses, so a new use fails loudly (AttributeError) rather than silently;
* ``kernels.compile.get_kernel`` (and every name bound to it or to ``launch_ex`` in an imported ``kernels`` /
  ``tools`` module) gives an :class:`EmulatedKernel`: the kernel's real CUDA C, built by g++ into a shared library
  per (source text, knobs) with ``tests/warp_checks.py``'s emulation (every thread of a block a fiber, the block
  barrier, shared memory, atomics, ``WD_HOST_EMULATION``'s plain C++ for the inline PTX), launched through ctypes
  on the arrays' host pointers. Blocks run one at a time, in grid order (x fastest) or reversed.

A launch checks what the GPU's would: one argument per parameter of the kernel's ``extern "C" __global__``
signature, a CuPy array or an ``np.uint64`` address for a pointer, a NumPy scalar of the parameter's size and kind
for a value (CuPy passes a Python int as 8 bytes, so the GPU would read garbage for an ``int``), only the types
``launch_ex`` packs for a programmatic launch, the block's threads a multiple of 32 and at most 1024, and dynamic
shared memory past 48 KiB only where the kernel's ``max_dynamic_shared_size_bytes`` allows it. Every launch is
recorded in :attr:`EmulatedDevice.launches`.

The device reports compute capability 9.0, the name "NVIDIA H200" (the dispatch picks the H200's paths) and 132
SMs; its id (:data:`DEVICE_ID`) is one no machine has, so the caches keyed by device (kernel families, workspaces)
never hand emulated objects to a real GPU. An out-of-bounds access in a kernel is a real one here (a crash, or
silently wrong bytes), as is a deadlocked barrier (the emulation aborts the process).
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels.arrays import BF16
from tests.warp_checks import BLOCK_EMULATION, EMULATION_PRELUDE, build_library

DEVICE_ID = 97  # no real device has it: caches keyed by the device id keep emulated objects apart
DEVICE_NAME = "NVIDIA H200"
COMPUTE_CAPABILITY = "90"
SM_COUNT = 132
MAX_THREADS = 1024
DEFAULT_SHARED = 48 * 1024  # dynamic shared memory a launch may use without raising the kernel's attribute
MAX_SHARED = 227 * 1024  # sm_90's opt-in limit per block
ALIGNMENT = 256  # cudaMalloc's


# -- arrays --------------------------------------------------------------------------------------------------------
def _device_dtype(dtype: Any) -> np.dtype:
    """``dtype`` where CuPy has it (NumPy's numbers, and bfloat16 as the lab moves it); TypeError for the rest
    (float8: CuPy has none, the lab moves its bit patterns as uint8)."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "biufc" and dtype != BF16:
        raise TypeError(f"Unsupported dtype {dtype} (CuPy has no such type: move its bits, e.g. .view(np.uint8))")
    return dtype


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    dtype = _device_dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _device_copy(host: np.ndarray, dtype: Any = None) -> np.ndarray:
    host = np.asarray(host) if dtype is None else np.asarray(host).astype(dtype, copy=False)
    out = _aligned_empty(host.shape, host.dtype)
    out[...] = host
    return out


def _shape(shape: Any) -> tuple[int, ...]:
    return (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(s) for s in shape)


def _host(value: Any) -> Any:
    """A NumPy value for ``value``: an emulated array's host array, a tuple's items in turn, else itself."""
    if isinstance(value, ndarray):
        return value._a
    if isinstance(value, tuple):
        return tuple(_host(v) for v in value)
    return value


@dataclass(frozen=True)
class MemoryPointer:
    ptr: int


@dataclass(frozen=True)
class Flags:
    c_contiguous: bool
    f_contiguous: bool


class ndarray:  # noqa: N801 - cupy's name
    """A device array: a NumPy array in aligned host memory. Indexing and ``view`` / ``reshape`` give arrays that
    share its memory; ``get`` / ``copy`` / ``astype`` copy. NumPy cannot take it implicitly (as with CuPy)."""

    __module__ = "cupy"

    def __init__(self, host: np.ndarray) -> None:
        if not isinstance(host, np.ndarray):
            raise TypeError(f"an emulated device array holds a numpy.ndarray, got {type(host).__name__}")
        _device_dtype(host.dtype)
        self._a = host

    # what the checks read
    shape = property(lambda self: self._a.shape)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    dtype = property(lambda self: self._a.dtype)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: Flags(bool(self._a.flags.c_contiguous), bool(self._a.flags.f_contiguous)))
    data = property(lambda self: MemoryPointer(int(self._a.ctypes.data)))
    T = property(lambda self: ndarray(self._a.T))

    def __repr__(self) -> str:
        return f"emulated cupy.ndarray({self._a!r})"

    def __len__(self) -> int:
        return len(self._a)

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a "
                        "NumPy array explicitly.")

    def __getitem__(self, key: Any) -> ndarray:
        got = self._a[_host(key)]
        return ndarray(got if isinstance(got, np.ndarray) else np.array(got))

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[_host(key)] = _host(value)

    # host transfers and copies
    def get(self, stream: Any = None, order: str = "C", out: np.ndarray | None = None) -> np.ndarray:
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        arr = np.asarray(arr)
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError(f"set: shape / dtype mismatch ({arr.shape} {arr.dtype} into {self._a.shape} "
                             f"{self._a.dtype})")
        self._a[...] = arr

    def copy(self, order: str = "C") -> ndarray:
        return ndarray(_device_copy(self._a))

    def astype(self, dtype: Any, copy: bool = True) -> ndarray:
        if not copy and np.dtype(dtype) == self._a.dtype:
            return self
        return ndarray(_device_copy(self._a, dtype))

    def view(self, dtype: Any) -> ndarray:
        return ndarray(self._a.view(_device_dtype(dtype)))

    def reshape(self, *shape: Any) -> ndarray:
        return ndarray(self._a.reshape(*shape))

    def ravel(self) -> ndarray:
        return ndarray(self._a.ravel())

    def transpose(self, *axes: Any) -> ndarray:
        return ndarray(self._a.transpose(*axes))

    def fill(self, value: Any) -> None:
        self._a.fill(value)

    def tolist(self) -> Any:
        return self._a.tolist()

    def item(self) -> Any:
        return self._a.item()

    def __int__(self) -> int:
        return int(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def __bool__(self) -> bool:
        return bool(self._a)

    def __index__(self) -> int:
        return self._a.__index__()

    def _reduce(self, name: str, *args: Any, **kwargs: Any) -> ndarray:
        return _wrap(getattr(self._a, name)(*args, **kwargs))

    def sum(self, *args: Any, **kwargs: Any) -> ndarray:
        return self._reduce("sum", *args, **kwargs)

    def max(self, *args: Any, **kwargs: Any) -> ndarray:
        return self._reduce("max", *args, **kwargs)

    def min(self, *args: Any, **kwargs: Any) -> ndarray:
        return self._reduce("min", *args, **kwargs)

    def all(self, *args: Any, **kwargs: Any) -> ndarray:
        return self._reduce("all", *args, **kwargs)

    def any(self, *args: Any, **kwargs: Any) -> ndarray:
        return self._reduce("any", *args, **kwargs)


def _wrap(value: Any) -> ndarray:
    """A result of NumPy arithmetic as a device array (new memory, aligned)."""
    return ndarray(_device_copy(np.asarray(value)))


def _binary(name: str) -> Any:
    def op(self: ndarray, other: Any) -> Any:
        result = getattr(self._a, name)(_host(other))
        return NotImplemented if result is NotImplemented else _wrap(result)

    op.__name__ = name
    return op


def _unary(name: str) -> Any:
    def op(self: ndarray) -> ndarray:
        return _wrap(getattr(self._a, name)())

    op.__name__ = name
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "and", "or", "xor", "lshift", "rshift", "pow"):
    setattr(ndarray, f"__{_name}__", _binary(f"__{_name}__"))
    setattr(ndarray, f"__r{_name}__", _binary(f"__r{_name}__"))
for _name in ("eq", "ne", "lt", "le", "gt", "ge"):
    setattr(ndarray, f"__{_name}__", _binary(f"__{_name}__"))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(ndarray, f"__{_name}__", _unary(f"__{_name}__"))
ndarray.__hash__ = None  # type: ignore[assignment]  # __eq__ is elementwise, as in CuPy


# -- the module's functions ----------------------------------------------------------------------------------------
def empty(shape: Any, dtype: Any = np.float64, order: str = "C") -> ndarray:
    """Uninitialized device memory: here every byte 0xFF (a NaN in every float format, -1 in every int), so a kernel
    that reads what nothing wrote shows it."""
    out = _aligned_empty(_shape(shape), dtype)
    out.view(np.uint8).reshape(-1)[...] = 0xFF
    return ndarray(out)


def zeros(shape: Any, dtype: Any = np.float64, order: str = "C") -> ndarray:
    out = _aligned_empty(_shape(shape), dtype)
    out.view(np.uint8).reshape(-1)[...] = 0
    return ndarray(out)


def ones(shape: Any, dtype: Any = np.float64) -> ndarray:
    return full(shape, 1, dtype)


def full(shape: Any, fill_value: Any, dtype: Any = None) -> ndarray:
    dtype = np.asarray(fill_value).dtype if dtype is None else dtype
    out = _aligned_empty(_shape(shape), dtype)
    out[...] = fill_value
    return ndarray(out)


def empty_like(a: ndarray, dtype: Any = None) -> ndarray:
    return empty(a.shape, a.dtype if dtype is None else dtype)


def zeros_like(a: ndarray, dtype: Any = None) -> ndarray:
    return zeros(a.shape, a.dtype if dtype is None else dtype)


def asarray(a: Any, dtype: Any = None) -> ndarray:
    """A device array of ``a``: ``a`` itself where it is one already (of ``dtype``), else a copy to the device."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return ndarray(_device_copy(np.asarray(a), dtype))


def array(a: Any, dtype: Any = None, copy: bool = True) -> ndarray:
    if isinstance(a, ndarray):
        return a.astype(a.dtype if dtype is None else dtype)
    return ndarray(_device_copy(np.asarray(a), dtype))


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    device = asarray(a, dtype)
    return device if device.flags.c_contiguous else device.copy()


def arange(*args: Any, dtype: Any = None) -> ndarray:
    return ndarray(_device_copy(np.arange(*args, dtype=dtype)))


def asnumpy(a: Any, stream: Any = None) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def isfinite(a: ndarray) -> ndarray:
    return _wrap(np.isfinite(a._a))


def array_equal(a: ndarray, b: ndarray) -> ndarray:
    return _wrap(np.array_equal(_host(a), _host(b)))


class _Generator:
    def __init__(self, seed: Any) -> None:
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, size: Any = None, dtype: Any = np.float64) -> ndarray:
        return ndarray(_device_copy(self._rng.standard_normal(_shape(size), dtype=dtype)))

    def random(self, size: Any = None, dtype: Any = np.float64) -> ndarray:
        return ndarray(_device_copy(self._rng.random(_shape(size), dtype=dtype)))


# -- cupy.cuda -------------------------------------------------------------------------------------------------------
class Stream:
    """A stream: launches run at once, in order, so it never has work pending; no graph capture."""

    null: Stream

    def __init__(self, non_blocking: bool = False, ptr: int = 0x5EED) -> None:
        self.ptr = ptr

    def synchronize(self) -> None:
        pass

    def is_capturing(self) -> bool:
        return False

    def use(self) -> Stream:
        return self

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def begin_capture(self, *args: Any) -> None:
        raise NotImplementedError("the emulated device captures no CUDA graphs")


Stream.null = Stream(ptr=0)


class Device:
    def __init__(self, device: int | None = None) -> None:
        if device is not None and int(device) != DEVICE_ID:
            raise ValueError(f"the emulated device is device {DEVICE_ID}, got {device}")
        self.id = DEVICE_ID
        self.compute_capability = COMPUTE_CAPABILITY

    def use(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _runtime() -> types.ModuleType:
    runtime = types.ModuleType("cupy.cuda.runtime")
    runtime.cudaDevAttrMultiProcessorCount = 16  # the CUDA runtime's value
    runtime.getDevice = lambda: DEVICE_ID
    runtime.getDeviceCount = lambda: 1
    runtime.deviceSynchronize = lambda: None

    def device_attribute(attribute: int, device: int) -> int:
        if attribute == runtime.cudaDevAttrMultiProcessorCount:
            return SM_COUNT
        raise NotImplementedError(f"the emulated device knows no attribute {attribute}")

    runtime.deviceGetAttribute = device_attribute
    runtime.getDeviceProperties = lambda device: {"name": DEVICE_NAME.encode(), "multiProcessorCount": SM_COUNT,
                                                  "major": 9, "minor": 0}
    return runtime


def make_cupy() -> dict[str, types.ModuleType]:
    """The emulated ``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime`` and ``cupy.random`` modules (sys.modules' keys)."""
    cupy = types.ModuleType("cupy")
    cupy.__doc__ = "The emulated CuPy device of tests/emulated_device.py (NumPy arrays, kernels run by g++ code)."
    cupy.ndarray = ndarray
    for name in ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "asarray", "array",
                 "ascontiguousarray", "arange", "asnumpy", "isfinite", "array_equal"):
        setattr(cupy, name, globals()[name])
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "bool_", "dtype"):
        setattr(cupy, name, getattr(np, name))
    cuda = types.ModuleType("cupy.cuda")
    runtime = _runtime()
    cuda.runtime = runtime
    cuda.Device = Device
    cuda.Stream = Stream
    cuda.get_current_stream = lambda: Stream.null
    cupy.cuda = cuda
    random = types.ModuleType("cupy.random")
    random.default_rng = _Generator
    cupy.random = random
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupy.random": random}


# -- kernels ---------------------------------------------------------------------------------------------------------
# parameter type -> (size, kind) for the values a kernel takes (kinds: "i" int, "f" float, "b" bool)
SCALARS = {
    "int": (4, "i"), "signed": (4, "i"), "int32_t": (4, "i"), "unsigned": (4, "i"), "unsigned int": (4, "i"),
    "u32": (4, "i"), "uint32_t": (4, "i"), "long long": (8, "i"), "long long int": (8, "i"), "int64_t": (8, "i"),
    "unsigned long long": (8, "i"), "unsigned long long int": (8, "i"), "uint64_t": (8, "i"), "size_t": (8, "i"),
    "short": (2, "i"), "unsigned short": (2, "i"), "bf16_t": (2, "i"), "float": (4, "f"), "double": (8, "f"),
    "bool": (1, "b"),
}
PROGRAMMATIC_TYPES = (np.int32, np.uint64, np.float32)  # what kernels.compile.launch_ex packs for cuLaunchKernelEx
_SIGNATURE = re.compile(r'extern\s+"C"\s+__global__\s+void\b')
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?(\w+)\s+(\w+)\s*\[\s*\]")
_HIDDEN_SHARED = re.compile(r"#ifndef\s+WD_HOST_EMULATION[^\n]*\n(\s*extern\s+__shared__[^\n;]*;[^\n]*)\n#endif")


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its C type as written, whether a pointer, and a value's (size, kind)."""

    text: str
    pointer: bool
    scalar: tuple[int, str] | None


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", text, flags=re.S))


def kernel_signatures(text: str) -> dict[str, tuple[Param, ...]]:
    """Each ``extern "C" __global__`` kernel of ``text`` (comments stripped) -> its parameters in order. Between
    ``void`` and the name: attributes with arguments (``__launch_bounds__(...)``) and macros naming them."""
    code = _strip_comments(text)
    signatures: dict[str, tuple[Param, ...]] = {}
    for match in _SIGNATURE.finditer(code):
        pos = match.end()
        while True:
            word = re.compile(r"\s*(\w+)\s*").match(code, pos)
            if word is None:
                break
            pos = word.end()
            if code[pos : pos + 1] != "(":
                continue  # a macro before the name (GU_BOUNDS)
            close = _closing(code, pos)
            if word.group(1) in ATTRIBUTES:
                pos = close
                continue
            params = [p.strip() for p in _split_top(code[pos + 1 : close - 1]) if p.strip()]
            signatures[word.group(1)] = tuple(_param(p) for p in params if p != "void")
            break
    return signatures


ATTRIBUTES = ("__launch_bounds__", "__maxnreg__", "__cluster_dims__")


def _closing(code: str, start: int) -> int:
    """The index past the parenthesis that closes the one at ``start``."""
    depth, end = 0, start
    while True:
        depth += {"(": 1, ")": -1}.get(code[end], 0)
        end += 1
        if depth == 0:
            return end


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses and angle brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, "<": 1, ")": -1, ">": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _param(text: str) -> Param:
    words = re.sub(r"\b(const|volatile|__restrict__|__restrict|restrict)\b", " ", text).replace("*", " * ").split()
    pointer = "*" in words
    base = " ".join(w for w in words[:-1] if w != "*")  # the last word is the parameter's name
    return Param(text, pointer, None if pointer else SCALARS.get(base, (0, "?")))


def emulation_text(text: str) -> str:
    """``text`` for the host emulation: each dynamic shared array (``extern __shared__ T name[]``, also one a source
    hides from the host emulation behind ``#ifndef WD_HOST_EMULATION``) a pointer to the emulated dynamic shared
    memory."""
    text = _HIDDEN_SHARED.sub(lambda m: m.group(1), text)
    return _EXTERN_SHARED.sub(lambda m: f"{m.group(1)}* const {m.group(2)} = reinterpret_cast<{m.group(1)}*>"
                                        "(g_dynamic_smem)", text)


LAUNCHER = r"""
#include <type_traits>
#include <utility>
template <class... A, size_t... I>
void emu_call(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<A*>(params[I])...);
}
// Every block of the grid in turn (x fastest; order 1: the reverse), each block's threads fibers (run_lanes) meeting
// at the block barrier and their warps' barriers; the dynamic shared memory poisoned (0xFF) before each block.
template <class... A>
int emu_launch(void (*kernel)(A...), const unsigned* grid, const unsigned* block, unsigned long long shared,
               int order, void** params) {
    const unsigned threads = block[0] * block[1] * block[2];
    const unsigned long long blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    if (threads == 0 || threads % 32 || shared > sizeof(g_dynamic_smem)) return 1;
    gridDim = Dim3{grid[0], grid[1], grid[2]};
    blockDim = Dim3{block[0], block[1], block[2]};
    EmuBarrier block_bar((std::ptrdiff_t)threads);
    g_block = &block_bar;
    std::vector<std::unique_ptr<WarpCtx>> warps;
    for (unsigned w = 0; w < threads / 32; ++w) warps.emplace_back(new WarpCtx);
    for (unsigned long long i = 0; i < blocks; ++i) {
        const unsigned long long b = order ? blocks - 1 - i : i;
        const Dim3 bid{(unsigned)(b % grid[0]), (unsigned)(b / grid[0] % grid[1]), (unsigned)(b / grid[0] / grid[1])};
        memset(g_dynamic_smem, 0xFF, shared);
        run_lanes((int)threads, [&](int l) {
            g_warp = warps[l / 32].get();
            threadIdx = Dim3{l % block[0], l / block[0] % block[1], l / block[0] / block[1]};
            blockIdx = bid;
            emu_call(kernel, params, std::index_sequence_for<A...>{});
        });
    }
    return 0;
}
"""


def library_text(names: tuple[str, ...]) -> str:
    """The harness around kernel.cu: the emulation, then one ``emu_launch_<name>`` entry point per kernel."""
    entries = "".join(
        f'extern "C" __attribute__((visibility("default"))) int emu_launch_{name}(const unsigned* grid, '
        "const unsigned* block, unsigned long long shared, int order, void** params) {\n"
        f"    return emu_launch(&{name}, grid, block, shared, order, params);\n}}\n" for name in names)
    return EMULATION_PRELUDE + BLOCK_EMULATION + '#include "kernel.cu"\n' + LAUNCHER + entries


@dataclass(frozen=True)
class Launch:
    """One emulated launch, as :attr:`EmulatedDevice.launches` records it."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    programmatic: bool


class EmulatedKernel:
    """A kernel of a CUDA C text: called as a ``cupy.RawKernel`` (``kernel(grid, block, args, shared_mem=)``) it runs
    the g++ build of that text on the arguments' host memory."""

    def __init__(self, text: str, name: str, names: tuple[str, ...]) -> None:
        signatures = kernel_signatures(text)
        missing = [n for n in names if n not in signatures]
        if missing:
            raise ValueError(f"no extern \"C\" __global__ signature for {missing} in the kernel text")
        self.name, self.params = name, signatures[name]
        self.library = _library(text, names)
        self.entry = getattr(self.library, f"emu_launch_{name}")
        self.entry.restype = ctypes.c_int
        self.max_dynamic_shared_size_bytes = DEFAULT_SHARED

    def __repr__(self) -> str:
        return f"EmulatedKernel({self.name})"

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], *,
                 shared_mem: int = 0, programmatic: bool = False) -> None:
        grid3, block3 = _dim3("grid", grid), _dim3("block", block)
        threads = block3[0] * block3[1] * block3[2]
        if threads > MAX_THREADS or threads % 32:
            raise ValueError(f"{self.name}: a block of {threads} threads (the emulation takes whole warps, "
                             f"at most {MAX_THREADS})")
        if grid3[1] > 65535 or grid3[2] > 65535 or grid3[0] >= 2**31:
            raise ValueError(f"{self.name}: grid {grid3} past CUDA's limits")
        shared_mem = int(shared_mem)
        if shared_mem > MAX_SHARED or (shared_mem > DEFAULT_SHARED and shared_mem > self.max_dynamic_shared_size_bytes):
            raise ValueError(f"{self.name}: {shared_mem} bytes of dynamic shared memory, the kernel allows "
                             f"{self.max_dynamic_shared_size_bytes} (set max_dynamic_shared_size_bytes)")
        if not isinstance(args, tuple):
            raise TypeError(f"{self.name}: args must be a tuple, got {type(args).__name__}")
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        if not _ACTIVE:
            raise RuntimeError(f"{self.name}: an emulated kernel launched outside emulated_device()")
        device = _ACTIVE[-1]
        keep = [self._value(index, param, arg, programmatic) for index, (param, arg) in
                enumerate(zip(self.params, args, strict=True))]
        pointers = (ctypes.c_void_p * max(1, len(keep)))(*[k.ctypes.data for k in keep])
        device.launches.append(Launch(self.name, grid3, block3, shared_mem, programmatic))
        done = self.entry((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(*block3), ctypes.c_ulonglong(shared_mem),
                          ctypes.c_int(int(device.reverse_blocks)), pointers)
        if done != 0:
            raise RuntimeError(f"{self.name}: the emulated launch failed ({done})")

    def _value(self, index: int, param: Param, arg: Any, programmatic: bool) -> np.ndarray:
        """The argument's bytes as the kernel's parameter takes them (a one-element array: its address is what the
        launcher reads); TypeError where the GPU's launch would pass something else."""
        where = f"{self.name} argument {index} ({param.text})"
        if programmatic and not isinstance(arg, (ndarray, *PROGRAMMATIC_TYPES)):
            raise TypeError(f"{where}: launch_ex cannot pass {type(arg).__name__} to a programmatic launch")
        if param.pointer:
            if isinstance(arg, ndarray):
                return np.array([arg.data.ptr], np.uint64)
            if isinstance(arg, np.uint64):
                return np.array([arg], np.uint64)
            raise TypeError(f"{where}: a pointer takes a device array or an np.uint64 address, got "
                            f"{type(arg).__name__}")
        size, kind = param.scalar or (0, "?")
        if kind == "?":
            raise TypeError(f"{where}: the emulation knows no parameter type {param.text!r}")
        if not isinstance(arg, np.generic):
            raise TypeError(f"{where}: pass a NumPy scalar of {size} bytes (CuPy passes a Python "
                            f"{type(arg).__name__} as 8 bytes), got {arg!r}")
        arg_kind = {"i": "i", "u": "i", "f": "f", "b": "b"}.get(arg.dtype.kind, "?")
        if arg.dtype.itemsize != size or arg_kind != kind:
            raise TypeError(f"{where}: takes {size}-byte {'float' if kind == 'f' else 'int'}, got {arg.dtype}")
        return np.array([arg])


_LIBRARIES: dict[tuple[str, tuple[str, ...]], Any] = {}  # (text, kernels) -> the loaded library, for the process
_ACTIVE: list[EmulatedDevice] = []  # the emulated devices entered (the last one records the launches)


def _library(text: str, names: tuple[str, ...]) -> Any:
    """The g++ build of ``text`` with an entry point per kernel of ``names``, loaded once per process (kernel
    families keep their kernels between tests: the emulated device's id keys them)."""
    key = (text, names)
    if key not in _LIBRARIES:
        path = build_library(emulation_text(text), library_text(names))
        _LIBRARIES[key] = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    return _LIBRARIES[key]


def _dim3(what: str, dims: Any) -> tuple[int, int, int]:
    dims = (int(dims),) if isinstance(dims, int | np.integer) else tuple(int(d) for d in dims)
    if not 1 <= len(dims) <= 3 or min(dims) < 1:
        raise ValueError(f"{what} must be 1 to 3 positive sizes, got {dims}")
    return (*dims, 1, 1)[:3]  # type: ignore[return-value]


@dataclass
class EmulatedDevice:
    """What :func:`emulated_device` yields: the fake ``cupy`` module, the launches so far, and the block order
    (``reverse_blocks``: the last block of the grid first, so a ticket's last block is another one)."""

    cupy: types.ModuleType
    launches: list[Launch] = field(default_factory=list)
    reverse_blocks: bool = False

    def get_kernel(self, source: Any, kernel: str, **defines: int) -> EmulatedKernel:
        """:func:`kernels.compile.get_kernel` on this device."""
        if kernel not in source.kernels:
            raise ValueError(f"{source.name} has no kernel {kernel!r}; it has {source.kernels}")
        names = tuple(source.compiled_kernels(**defines))
        if kernel not in names:
            raise ValueError(f"{source.name}: kernel {kernel!r} is not compiled with {defines}")
        return EmulatedKernel(source.render(**defines), kernel, names)

    def launch_ex(self, kernel: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], *,
                  shared_mem: int = 0, programmatic: bool = False, cooperative: bool = False) -> None:
        """:func:`kernels.compile.launch_ex` on this device (a cooperative launch: every block runs anyway)."""
        if not isinstance(kernel, EmulatedKernel):
            raise TypeError(f"the emulated device launches its own kernels, got {type(kernel).__name__}")
        kernel(grid, block, args, shared_mem=shared_mem, programmatic=programmatic)

    def max_active_blocks(self, kernel: Any, threads: int, shared_mem: int) -> int:
        return max(1, min(32, 2048 // max(1, int(threads))))

    def synchronize(self) -> None:
        """Nothing to wait for: every launch ran before it returned."""


_PATCHED = ("get_kernel", "launch_ex", "max_active_blocks")


def _swap(replacements: dict[int, Any]) -> list[tuple[Any, str, Any]]:
    """Set every attribute of an imported kernels / tools / tests module that is one of the objects keyed (by id)
    in ``replacements`` to its replacement; returns (module, name, old value) to undo it."""
    undo = []
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name.split(".")[0] not in ("kernels", "tools", "tests"):
            continue
        for name, value in list(vars(module).items()):
            if id(value) in replacements:
                undo.append((module, name, value))
                setattr(module, name, replacements[id(value)])
    return undo


@contextlib.contextmanager
def emulated_device() -> Iterator[EmulatedDevice]:
    """The emulated device installed: ``import cupy`` gives the fake module and the lab's kernels run through g++;
    everything is put back on exit (sys.modules' ``cupy`` entries, the patched names)."""
    import kernels.compile as compile_module

    modules = make_cupy()
    device = EmulatedDevice(modules["cupy"])
    saved = {name: sys.modules.get(name) for name in modules}
    originals = {name: getattr(compile_module, name) for name in _PATCHED}
    patched = {name: getattr(device, name) for name in _PATCHED}  # one bound method each: found again by id
    sys.modules.update(modules)
    undo = _swap({id(originals[name]): patched[name] for name in _PATCHED})
    _ACTIVE.append(device)
    try:
        yield device
    finally:
        _ACTIVE.remove(device)
        for module, name, value in reversed(undo):
            setattr(module, name, value)
        _swap({id(patched[name]): originals[name] for name in _PATCHED})  # modules imported inside the context
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
