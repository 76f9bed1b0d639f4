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
shared memory past 48 KiB only where the kernel's ``max_dynamic_shared_size_bytes`` allows it, every pointer (but
null) inside a live allocation. Every launch that runs (a graph's at each replay) is recorded in
:attr:`EmulatedDevice.launches`.

Streams and graphs, as the tools time a step (tools/decode.py, tools/roofline.py): work runs when it is issued, in
order, so nothing is ever pending (``synchronize`` waits for nothing); ``with stream`` makes a stream the current
one. Between ``begin_capture`` and ``end_capture`` a stream records its kernel launches (the arguments' bytes as they
were), ``memcpyAsync`` device copies, fills and stores into a :class:`Graph` whose ``launch`` replays them, each
kernel pointer checked to lie in a live allocation (a graph holds no arrays, as on a GPU). What a GPU refuses in a
capture is refused and invalidates it: synchronizing the stream or the device, a copy to or from the host, work on
the legacy stream while a blocking stream captures, a capture on the legacy stream. An operation that makes a new
array of device values (arithmetic, ``copy``) is not emulated in a capture (NotImplementedError). Events stamp the
host's clock at ``record``: ``get_elapsed_time`` is wall-clock between records, a number for the code path, no GPU
timing.

The device reports compute capability 9.0, the name "NVIDIA H200" (the dispatch picks the H200's paths) and 132
SMs; its id (:data:`DEVICE_ID`) is one no machine has, so the caches keyed by device (kernel families, workspaces)
never hand emulated objects to a real GPU. Its memory is ``emulated_device(memory=)`` bytes of the host's
(:data:`DEVICE_MEMORY`, 64 MiB, by default: what the tools size from ``memGetInfo`` stays small); an allocation past
it raises OutOfMemoryError, and the live emulated arrays are what ``memGetInfo`` counts as used. No clocks, no
driver (its versions are 0). An out-of-bounds access in a kernel is a real one here (a crash, or silently wrong
bytes), as is a deadlocked barrier (the emulation aborts the process).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import re
import sys
import time
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels.arrays import BF16
from tests.warp_checks import BLOCK_EMULATION, EMULATION_PRELUDE, build_library

DEVICE_ID = 97  # no real device has it: caches keyed by the device id keep emulated objects apart
DEVICE_NAME = "NVIDIA H200"
COMPUTE_CAPABILITY = "90"
SM_COUNT = 132
L2_BYTES = 50 * 1024 * 1024
DEVICE_MEMORY = 64 * 1024 * 1024  # the memory an emulated device lends (host memory; memGetInfo says it)
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


# The live allocations (start address -> bytes; _STARTS sorted), each dropped when its memory is freed: what a
# pointer a kernel or a copy is handed must lie in, and what the device's memory (memGetInfo) is charged with.
_ALLOCATIONS: dict[int, int] = {}
_STARTS: list[int] = []


def _release(start: int) -> None:
    del _ALLOCATIONS[start]
    del _STARTS[bisect.bisect_left(_STARTS, start)]


def used_bytes() -> int:
    """The bytes of the emulated arrays alive (allocated and not yet freed), every device's together."""
    return sum(_ALLOCATIONS.values())


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    dtype = _device_dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if _ACTIVE and used_bytes() + nbytes > _ACTIVE[-1].memory:
        raise OutOfMemoryError(f"Out of memory allocating {nbytes:,} bytes (allocated so far: {used_bytes():,} "
                               f"bytes of the emulated device's {_ACTIVE[-1].memory:,})")
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    _ALLOCATIONS[raw.ctypes.data + start] = nbytes
    bisect.insort(_STARTS, raw.ctypes.data + start)
    weakref.finalize(raw, _release, raw.ctypes.data + start)
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def check_live(address: int, nbytes: int, what: str) -> None:
    """RuntimeError unless ``[address, address + nbytes)`` lies inside one live allocation (a freed buffer's memory
    is another array's, or nobody's, on a GPU: here it is a crash)."""
    index = bisect.bisect_right(_STARTS, address) - 1
    if index < 0 or address + nbytes > _STARTS[index] + _ALLOCATIONS[_STARTS[index]]:
        raise RuntimeError(f"{what}: {nbytes} bytes at {address:#x} lie in no live allocation (freed memory, or "
                           "not device memory)")


class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError: an allocation past the emulated device's memory."""

    __module__ = "cupy.cuda.memory"


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
        if not isinstance(got, np.ndarray):  # one element: a 0-d view of it, as in CuPy
            got = self._a[(*_host(key if isinstance(key, tuple) else (key,)), Ellipsis)]
        return ndarray(got)

    def __setitem__(self, key: Any, value: Any) -> None:
        # a device value or a scalar: a copy kernel on the stream (captured); a host array: a copy from the host first
        on_device = isinstance(value, ndarray | int | float | bool | np.generic)
        hkey, hvalue = _host(key), _host(value)
        _stream_work("an assignment (__setitem__)", lambda: self._a.__setitem__(hkey, hvalue), on_device)

    # host transfers and copies
    def get(self, stream: Any = None, order: str = "C", out: np.ndarray | None = None) -> np.ndarray:
        _stream_work("a copy to the host (get)", None, False, stream)
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        arr = np.asarray(arr)
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError(f"set: shape / dtype mismatch ({arr.shape} {arr.dtype} into {self._a.shape} "
                             f"{self._a.dtype})")
        _stream_work("a copy from the host (set)", None, False, stream)
        self._a[...] = arr

    def copy(self, order: str = "C") -> ndarray:
        _stream_work("copy", None, None)
        return ndarray(_device_copy(self._a))

    def astype(self, dtype: Any, copy: bool = True) -> ndarray:
        if not copy and np.dtype(dtype) == self._a.dtype:
            return self
        _stream_work("astype", None, None)
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
        _stream_work("fill", lambda: self._a.fill(value), True)

    def _read(self, what: str) -> np.ndarray:
        _stream_work(f"a read to the host ({what})", None, False)
        return self._a

    def tolist(self) -> Any:
        return self._read("tolist").tolist()

    def item(self) -> Any:
        return self._read("item").item()

    def __int__(self) -> int:
        return int(self._read("int"))

    def __float__(self) -> float:
        return float(self._read("float"))

    def __bool__(self) -> bool:
        return bool(self._read("bool"))

    def __index__(self) -> int:
        return self._read("index").__index__()

    def _reduce(self, name: str, *args: Any, **kwargs: Any) -> ndarray:
        _stream_work(name, None, None)
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
        _stream_work(name, None, None)
        result = getattr(self._a, name)(_host(other))
        return NotImplemented if result is NotImplemented else _wrap(result)

    op.__name__ = name
    return op


def _unary(name: str) -> Any:
    def op(self: ndarray) -> ndarray:
        _stream_work(name, None, None)
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
    return full(shape, 0, np.float64 if dtype is None else dtype)


def ones(shape: Any, dtype: Any = np.float64) -> ndarray:
    return full(shape, 1, dtype)


def full(shape: Any, fill_value: Any, dtype: Any = None) -> ndarray:
    dtype = np.asarray(fill_value).dtype if dtype is None else dtype
    out = empty(shape, dtype)
    out.fill(fill_value)  # a memset / fill kernel on the stream: captured in a graph
    return out


def empty_like(a: ndarray, dtype: Any = None) -> ndarray:
    return empty(a.shape, a.dtype if dtype is None else dtype)


def zeros_like(a: ndarray, dtype: Any = None) -> ndarray:
    return zeros(a.shape, a.dtype if dtype is None else dtype)


def asarray(a: Any, dtype: Any = None) -> ndarray:
    """A device array of ``a``: ``a`` itself where it is one already (of ``dtype``), else a copy to the device."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    _stream_work("a copy from the host (asarray)", None, False)
    return ndarray(_device_copy(np.asarray(a), dtype))


def array(a: Any, dtype: Any = None, copy: bool = True) -> ndarray:
    if isinstance(a, ndarray):
        return a.astype(a.dtype if dtype is None else dtype)
    _stream_work("a copy from the host (array)", None, False)
    return ndarray(_device_copy(np.asarray(a), dtype))


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    device = asarray(a, dtype)
    return device if device.flags.c_contiguous else device.copy()


def arange(*args: Any, dtype: Any = None) -> ndarray:
    _stream_work("arange", None, None)
    return ndarray(_device_copy(np.arange(*args, dtype=dtype)))


def asnumpy(a: Any, stream: Any = None) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def isfinite(a: ndarray) -> ndarray:
    _stream_work("isfinite", None, None)
    return _wrap(np.isfinite(a._a))


def count_nonzero(a: ndarray, axis: Any = None) -> Any:
    _stream_work("count_nonzero", None, None)
    result = np.count_nonzero(_host(a), axis=axis)
    return int(result) if axis is None else _wrap(result)


def where(condition: Any, x: Any, y: Any) -> ndarray:
    _stream_work("where", None, None)
    return _wrap(np.where(_host(condition), _host(x), _host(y)))


def array_equal(a: ndarray, b: ndarray) -> ndarray:
    _stream_work("array_equal", None, None)
    return _wrap(np.array_equal(_host(a), _host(b)))


class _Generator:
    def __init__(self, seed: Any) -> None:
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, size: Any = None, dtype: Any = np.float64) -> ndarray:
        _stream_work("standard_normal", None, None)
        return ndarray(_device_copy(self._rng.standard_normal(_shape(size), dtype=dtype)))

    def random(self, size: Any = None, dtype: Any = np.float64) -> ndarray:
        _stream_work("random", None, None)
        return ndarray(_device_copy(self._rng.random(_shape(size), dtype=dtype)))


# -- cupy.cuda -------------------------------------------------------------------------------------------------------
class CUDARuntimeError(RuntimeError):
    """CuPy's CUDARuntimeError: what the CUDA runtime refuses (its error's name first, as CuPy says it)."""

    __module__ = "cupy_backends.cuda.api.runtime"


def _device() -> EmulatedDevice:
    if not _ACTIVE:
        raise RuntimeError("the emulated CUDA runtime used outside emulated_device()")
    return _ACTIVE[-1]


def _current_stream() -> Stream:
    return _ACTIVE[-1].current if _ACTIVE else Stream.null


def _nothing() -> None:
    pass


def _stream_work(what: str, fn: Callable[[], None] | None, capturable: bool | None, stream: Any = None) -> None:
    """Work CuPy issues on ``stream`` (default the current one): ``fn`` run now, or on a capturing stream recorded
    (``capturable`` True: a kernel, a device copy, a fill or store) or refused: False where the GPU refuses it (a
    synchronous copy to or from the host), None where the emulation cannot replay it (an operation that makes a new
    array of device values: its result would be computed at the capture, not at the replays)."""
    if not _ACTIVE:
        if fn is not None:
            fn()
        return
    _ACTIVE[-1].submit(_current_stream() if stream is None else stream, fn or _nothing, what, capturable)


_STREAMS: weakref.WeakValueDictionary[int, Stream] = weakref.WeakValueDictionary()  # ptr -> stream, for copies


class Stream:
    """A stream: work on it runs when it is issued, in order, so nothing is ever pending; ``with stream`` / ``use``
    make it the current one. Between ``begin_capture`` and ``end_capture`` its kernel launches, device copies, fills
    and stores are recorded into the :class:`Graph` (the arguments' values as they were), not run; what the GPU
    refuses in a capture is refused and invalidates it (``end_capture`` then raises, as CUDA's does): synchronizing
    the stream or the device, a copy to or from the host, work on the legacy stream while a blocking stream
    captures; a capture cannot begin on the legacy stream."""

    null: Stream
    _ptrs = itertools.count(0x5EED00, 0x100)

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int | None = None,
                 priority: int | None = None) -> None:
        self.ptr = 0 if null else next(Stream._ptrs) if ptr is None else int(ptr)
        self.non_blocking = bool(non_blocking)
        self._capture: list[Callable[[], None]] | None = None
        self._invalid: str | None = None
        if self.ptr:
            _STREAMS[self.ptr] = self

    def __repr__(self) -> str:
        return f"<emulated cupy.cuda.Stream {self.ptr:#x}{' (capturing)' if self._capture is not None else ''}>"

    def synchronize(self) -> None:
        _device().sync(self, "synchronize")

    def is_capturing(self) -> bool:
        return self._capture is not None

    def use(self) -> Stream:
        _device().current = self
        return self

    def __enter__(self) -> Stream:
        device = _device()
        device.saved.append(device.current)
        device.current = self
        return self

    def __exit__(self, *exc: Any) -> None:
        device = _device()
        device.current = device.saved.pop()

    def begin_capture(self, mode: Any = None) -> None:
        device = _device()
        if self.ptr == 0:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported: a capture cannot begin on the legacy stream")
        if self._capture is not None:
            raise CUDARuntimeError("cudaErrorIllegalState: the stream is capturing already")
        self._capture, self._invalid = [], None
        device.capturing.append(self)

    def end_capture(self) -> Graph:
        device = _device()
        if self._capture is None:
            raise CUDARuntimeError("cudaErrorIllegalState: the stream is not capturing")
        nodes, self._capture = self._capture, None
        device.capturing.remove(self)
        if self._invalid is not None:
            # CUDA's words: the cause was the error of the call that invalidated the capture
            raise CUDARuntimeError("cudaErrorStreamCaptureInvalidated: operation failed due to a previous error "
                                   "during capture")
        return Graph(tuple(nodes), device)

    def _invalidate(self, why: str) -> None:
        if self._invalid is None:
            self._invalid = why


Stream.null = Stream(null=True)


class Graph:
    """A captured graph: ``launch`` runs its recorded work in order on a stream (a kernel's pointers must still lie
    in live allocations: a graph holds no arrays, as on a GPU)."""

    __module__ = "cupy.cuda.graph"

    def __init__(self, nodes: tuple[Callable[[], None], ...], device: EmulatedDevice) -> None:
        self._nodes, self._device = nodes, device

    def __len__(self) -> int:
        return len(self._nodes)

    def launch(self, stream: Any = None) -> None:
        device = _device()
        if device is not self._device:
            raise RuntimeError("a graph launched on another device than the one that captured it")
        device.submit(_current_stream() if stream is None else stream, self._replay, "a graph launch", None)

    def upload(self, stream: Any = None) -> None:
        pass

    def _replay(self) -> None:
        for node in self._nodes:
            node()


class Event:
    """An event: ``record`` stamps the host's clock (the work before it is done when it returns), so
    :func:`get_elapsed_time` gives the wall-clock between two records -- a number, not a GPU timing. An event recorded
    in a capture, never recorded, or made with ``disable_timing`` has no time (as CUDA's)."""

    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self.disable_timing = bool(disable_timing)
        self._at: float | None = None

    def record(self, stream: Any = None) -> None:
        stream = _current_stream() if stream is None else stream
        if stream.is_capturing():
            self._at = None  # a dependency inside the capture, no timestamp
            return
        _device().check_legacy(stream, "an event record")
        self._at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    @property
    def done(self) -> bool:
        return True


def get_elapsed_time(start: Event, stop: Event) -> float:
    """Milliseconds between the records of ``start`` and ``stop`` (host wall-clock)."""
    for event in (start, stop):
        if event.disable_timing or event._at is None:
            raise CUDARuntimeError("cudaErrorInvalidResourceHandle: an event without a time (made with "
                                   "disable_timing, never recorded, or recorded in a capture)")
    return (stop._at - start._at) * 1e3  # type: ignore[operator]


class Device:
    def __init__(self, device: int | None = None) -> None:
        if device is not None and int(device) != DEVICE_ID:
            raise ValueError(f"the emulated device is device {DEVICE_ID}, got {device}")
        self.id = DEVICE_ID
        self.compute_capability = COMPUTE_CAPABILITY

    def use(self) -> None:
        pass

    def synchronize(self) -> None:
        _device().sync_all("Device.synchronize")

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class MemoryPool:
    """The default pool: an array's memory goes back when the array is freed, so there are no blocks to free."""

    def free_all_blocks(self, stream: Any = None) -> None:
        pass

    def used_bytes(self) -> int:
        return used_bytes()

    def total_bytes(self) -> int:
        return used_bytes()


_POOL = MemoryPool()


def _stream_at(ptr: int) -> Stream:
    if int(ptr) == 0:
        return Stream.null
    stream = _STREAMS.get(int(ptr))
    if stream is None:
        raise CUDARuntimeError(f"cudaErrorInvalidResourceHandle: no stream {int(ptr):#x}")
    return stream


def _check_device(device: int) -> None:
    if int(device) != DEVICE_ID:
        raise CUDARuntimeError(f"cudaErrorInvalidDevice: the emulated device is device {DEVICE_ID}, got {device}")


def _runtime() -> types.ModuleType:
    runtime = types.ModuleType("cupy.cuda.runtime")
    runtime.CUDARuntimeError = CUDARuntimeError
    runtime.cudaDevAttrMultiProcessorCount = 16  # the CUDA runtime's values
    runtime.memcpyHostToDevice, runtime.memcpyDeviceToHost, runtime.memcpyDeviceToDevice = 1, 2, 3
    runtime.getDevice = lambda: DEVICE_ID
    runtime.getDeviceCount = lambda: 1
    runtime.deviceSynchronize = lambda: _device().sync_all("deviceSynchronize")
    runtime.driverGetVersion = lambda: 0  # no CUDA driver: the kernels run on the host
    runtime.runtimeGetVersion = lambda: 0
    runtime.memGetInfo = lambda: (_device().memory - used_bytes(), _device().memory)

    def device_attribute(attribute: int, device: int) -> int:
        _check_device(device)
        if attribute == runtime.cudaDevAttrMultiProcessorCount:
            return SM_COUNT
        raise NotImplementedError(f"the emulated device knows no attribute {attribute}")

    def properties(device: int) -> dict[str, Any]:
        # no clocks or bus width: an emulation has none (the tools' readers fall back to None)
        _check_device(device)
        return {"name": DEVICE_NAME.encode(), "multiProcessorCount": SM_COUNT, "major": 9, "minor": 0,
                "l2CacheSize": L2_BYTES, "totalGlobalMem": _device().memory}

    def memcpy_async(dst: int, src: int, size: int, kind: int, stream: int) -> None:
        if kind != runtime.memcpyDeviceToDevice:
            raise NotImplementedError(f"the emulated device copies device to device only, got kind {kind}")
        dst, src, size = int(dst), int(src), int(size)

        def copy() -> None:
            check_live(dst, size, "memcpyAsync's destination")
            check_live(src, size, "memcpyAsync's source")
            ctypes.memmove(dst, src, size)

        check_live(dst, size, "memcpyAsync's destination")
        check_live(src, size, "memcpyAsync's source")
        _device().submit(_stream_at(stream), copy, "memcpyAsync", True)

    runtime.deviceGetAttribute = device_attribute
    runtime.getDeviceProperties = properties
    runtime.memcpyAsync = memcpy_async
    return runtime


def make_cupy() -> dict[str, types.ModuleType]:
    """The emulated ``cupy``, ``cupy.cuda``, ``cupy.cuda.runtime`` and ``cupy.random`` modules (sys.modules' keys)."""
    cupy = types.ModuleType("cupy")
    cupy.__doc__ = "The emulated CuPy device of tests/emulated_device.py (NumPy arrays, kernels run by g++ code)."
    cupy.ndarray = ndarray
    for name in ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "asarray", "array",
                 "ascontiguousarray", "arange", "asnumpy", "isfinite", "count_nonzero", "where",
                 "array_equal"):
        setattr(cupy, name, globals()[name])
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "bool_", "dtype"):
        setattr(cupy, name, getattr(np, name))
    cuda = types.ModuleType("cupy.cuda")
    runtime = _runtime()
    cuda.runtime = runtime
    cuda.Device = Device
    cuda.Stream = Stream
    cuda.Event = Event
    cuda.get_elapsed_time = get_elapsed_time
    cuda.get_current_stream = _current_stream
    memory = types.ModuleType("cupy.cuda.memory")
    memory.OutOfMemoryError = OutOfMemoryError
    memory.MemoryPool = MemoryPool
    cuda.memory = memory
    graph = types.ModuleType("cupy.cuda.graph")
    graph.Graph = Graph
    cuda.graph = graph
    cupy.cuda = cuda
    cupy.get_default_memory_pool = lambda: _POOL
    random = types.ModuleType("cupy.random")
    random.default_rng = _Generator
    cupy.random = random
    return {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupy.cuda.memory": memory,
            "cupy.cuda.graph": graph, "cupy.random": random}


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
        keep = [self._value(index, param, arg, programmatic) for index, (param, arg) in
                enumerate(zip(self.params, args, strict=True))]
        launch = Launch(self.name, grid3, block3, shared_mem, programmatic)
        addresses = [(i, int(k[0])) for i, (param, k) in enumerate(zip(self.params, keep, strict=True))
                     if param.pointer and int(k[0]) != 0]
        _stream_work(f"the launch of {self.name}", lambda: self._run(launch, keep, addresses), True)

    def _run(self, launch: Launch, keep: list[np.ndarray], addresses: list[tuple[int, int]]) -> None:
        """The launch with the arguments' bytes ``keep`` (now, or replayed by a graph: the same values)."""
        device = _device()
        for index, address in addresses:
            check_live(address, 0, f"{self.name} argument {index} ({self.params[index].text})")
        pointers = (ctypes.c_void_p * max(1, len(keep)))(*[k.ctypes.data for k in keep])
        device.launches.append(launch)
        done = self.entry((ctypes.c_uint * 3)(*launch.grid), (ctypes.c_uint * 3)(*launch.block),
                          ctypes.c_ulonglong(launch.shared_mem), ctypes.c_int(int(device.reverse_blocks)), pointers)
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
    memory: int = DEVICE_MEMORY
    current: Stream = field(default_factory=lambda: Stream.null)  # the current stream, and those `with` replaced
    saved: list[Stream] = field(default_factory=list)
    capturing: list[Stream] = field(default_factory=list)

    def submit(self, stream: Stream, fn: Callable[[], None], what: str, capturable: bool | None) -> None:
        """``fn``, work issued on ``stream``: run now, recorded into the stream's capture, or refused
        (:func:`_stream_work`)."""
        if stream.is_capturing():
            if capturable:
                stream._capture.append(fn)  # type: ignore[union-attr]
                return
            if capturable is None:
                raise NotImplementedError(f"{what} on a capturing stream: the emulated device records kernel "
                                          "launches, device copies, fills and stores in a graph, nothing that makes "
                                          "a new array")
            stream._invalidate(what)
            raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: {what} is not permitted on a capturing "
                                   "stream")
        self.check_legacy(stream, what)
        fn()

    def check_legacy(self, stream: Stream, what: str) -> None:
        """Work on the legacy stream waits for every blocking stream: refused while one captures."""
        blocking = [s for s in self.capturing if not s.non_blocking]
        if stream.ptr == 0 and blocking:
            for s in blocking:
                s._invalidate(f"{what} on the legacy stream")
            raise CUDARuntimeError(f"cudaErrorStreamCaptureImplicit: {what} on the legacy stream while a blocking "
                                   "stream captures")

    def sync(self, stream: Stream, what: str) -> None:
        if stream.is_capturing():
            stream._invalidate(what)
            raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: {what} on a capturing stream")
        self.check_legacy(stream, what)

    def sync_all(self, what: str) -> None:
        if self.capturing:
            for s in self.capturing:
                s._invalidate(what)
            raise CUDARuntimeError(f"cudaErrorStreamCaptureUnsupported: {what} while a stream captures")

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
def emulated_device(memory: int = DEVICE_MEMORY) -> Iterator[EmulatedDevice]:
    """The emulated device installed: ``import cupy`` gives the fake module and the lab's kernels run through g++;
    everything is put back on exit (sys.modules' ``cupy`` entries, the patched names). ``memory``: the bytes it
    lends (allocations past them raise OutOfMemoryError; memGetInfo counts every live emulated array)."""
    import kernels.compile as compile_module

    modules = make_cupy()
    device = EmulatedDevice(modules["cupy"], memory=int(memory))
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
