"""Warp intrinsics for Numba's CUDA simulator, so the GPU kernels' own source runs on a CPU.

What numba-cuda 0.30's simulator (``NUMBA_ENABLE_CUDASIM=1``) already provides, read from
``numba/cuda/simulator/kernelapi.py`` and ``kernel.py``: every CUDA thread is a Python ``threading.Thread``
(``BlockThread``, with ``thread_id`` = its linear index in the block), blocks run one after another, and
``cuda.syncthreads()`` is a block-wide barrier; ``cuda.laneid``, ``cuda.warpsize``, ``cuda.local.array``,
atomics and fp16 exist. Missing: ``shfl_sync`` / ``shfl_up_sync`` / ``shfl_down_sync`` /
``shfl_xor_sync`` / ``syncwarp`` (and ``numba.cuda.bf16`` is a stub; the kernels convert bf16 with integer
shifts, so no bf16 shim is needed).

:func:`install` adds only the missing warp functions to the simulator's ``FakeCUDAModule`` class (the object
the simulator substitutes for ``cuda`` inside a running kernel). A shuffle is a two-phase exchange among the
32 threads of one warp: each lane writes its value into its warp's slot array, a per-warp
barrier (:class:`_WarpBarrier`) waits for every lane of the warp (not the whole block: a shuffle synchronises a
warp, like ``__shfl_sync``), then each lane reads its source lane's slot; consecutive shuffles alternate between
two slot arrays, so one barrier per shuffle suffices. Only the full mask (all 32 lanes
converged) is supported -- what the kernels use.

Nothing here runs, or is even reachable, on the GPU path: :func:`install` returns immediately unless the
simulator is enabled, and on a real GPU ``cuda.shfl_xor_sync`` is Numba's intrinsic.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

FULL_MASK = 0xFFFFFFFF
WARP = 32
BARRIER_TIMEOUT_S = 120.0  # a lane that never arrives (an exception in its warp) must not hang the test run
# the GIL's switch interval while simulating (see one_cpu): 0.5 ms made the simulator 10-15 % faster than 5 ms
SWITCH_INTERVAL_S = 0.0005

_registry_lock = threading.Lock()


def simulator_enabled() -> bool:
    """True when Numba's CUDA simulator replaces the GPU in this process."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        return False
    from numba.cuda import config

    return bool(config.ENABLE_CUDASIM)


class _WarpBarrier:
    """A barrier for one warp's lanes, counting generations on one condition variable.

    ``threading.Barrier`` holds a lane that arrives at barrier n+1 until every lane has left barrier n (its
    filling and draining phases), which costs a second round of wake-ups per shuffle; here a lane that has passed
    barrier n may arrive at n+1 at once (the two slot arrays of :class:`_WarpExchange` make that safe). A lane
    waits at most ``BARRIER_TIMEOUT_S``: then the barrier breaks and every lane waiting, or arriving later, raises
    ``threading.BrokenBarrierError`` -- as ``threading.Barrier`` does.
    """

    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        self.arrived = 0
        self.generation = 0
        self.broken = False
        self.condition = threading.Condition(threading.Lock())

    def wait(self) -> None:
        with self.condition:
            if self.broken:
                raise threading.BrokenBarrierError
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.lanes:
                self.arrived = 0
                self.generation += 1
                self.condition.notify_all()
                return
            deadline = time.monotonic() + BARRIER_TIMEOUT_S
            while generation == self.generation and not self.broken:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.broken = True
                    self.condition.notify_all()
                    break
                self.condition.wait(left)
            if generation == self.generation:
                raise threading.BrokenBarrierError


class _WarpExchange:
    """The slots and the barrier one simulated warp shuffles through.

    Two slot arrays used alternately (each lane flips its own ``parity``): a lane can start writing shuffle
    n+1 while slower lanes still read shuffle n, and cannot reach shuffle n+2's writes before every lane
    has passed shuffle n+1's barrier, i.e. finished reading n. One barrier per shuffle instead of two.
    """

    def __init__(self, lanes: int) -> None:
        self.values: tuple[list[Any], list[Any]] = ([None] * lanes, [None] * lanes)
        self.parity = [0] * lanes
        self.barrier = _WarpBarrier(lanes)


def _this_lane() -> tuple[_WarpExchange, int, int]:
    """(the current warp's exchange, this thread's lane, the warp's lane count)."""
    thread = threading.current_thread()
    manager = thread._manager  # the simulator's BlockManager of the running block
    warp, lane = divmod(thread.thread_id, WARP)
    exchanges = manager.__dict__.get("_simt_warps")
    if exchanges is None or warp not in exchanges:
        with _registry_lock:
            exchanges = manager.__dict__.setdefault("_simt_warps", {})
            if warp not in exchanges:
                block_threads = 1
                for extent in manager._block_dim:
                    block_threads *= extent
                exchanges[warp] = _WarpExchange(min(WARP, block_threads - warp * WARP))
    exchange = exchanges[warp]
    return exchange, lane, len(exchange.parity)


@contextlib.contextmanager
def one_cpu() -> Iterator[None]:
    """Run the enclosed simulation with the calling thread, and the block threads it starts, on one CPU, handing
    the GIL over every ``SWITCH_INTERVAL_S`` at most.

    The simulator's threads run in lockstep through barriers and hand the GIL over at every step; across cores each
    hand-off wakes another core, which made the same simulation 2-10x slower on two CPUs than on one (measured).
    The calling thread's CPU set is restored afterwards; threads started before (a compile worker) keep theirs.
    The simulator's block manager polls its threads in a loop that never blocks: whenever it holds the GIL, the lanes
    it polls wait out the interpreter's switch interval (5 ms by default) before they can run, so the interval is
    shortened for the simulation and restored afterwards.
    """
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
    try:
        with _pinned_to_one_cpu():
            yield
    finally:
        sys.setswitchinterval(interval)


@contextlib.contextmanager
def _pinned_to_one_cpu() -> Iterator[None]:
    getter, setter = getattr(os, "sched_getaffinity", None), getattr(os, "sched_setaffinity", None)
    if getter is None or setter is None:
        yield
        return
    before = getter(0)
    try:
        setter(0, {min(before)})
    except OSError:  # a restricted container: simulate as is
        yield
        return
    try:
        yield
    finally:
        setter(0, before)


def _shuffle(mask: int, value: Any, source_of: Any) -> Any:
    if int(mask) & FULL_MASK != FULL_MASK:
        raise NotImplementedError("the simulator shim supports only full-warp shuffles (mask 0xFFFFFFFF)")
    exchange, lane, lanes = _this_lane()
    slots = exchange.values[exchange.parity[lane]]
    exchange.parity[lane] ^= 1
    slots[lane] = value
    exchange.barrier.wait()
    source = source_of(lane)
    return slots[source] if 0 <= source < lanes else value


def shfl_sync(self: Any, mask: int, value: Any, src_lane: int) -> Any:
    return _shuffle(mask, value, lambda lane: int(src_lane) % WARP)


def shfl_up_sync(self: Any, mask: int, value: Any, delta: int) -> Any:
    return _shuffle(mask, value, lambda lane: lane - int(delta))


def shfl_down_sync(self: Any, mask: int, value: Any, delta: int) -> Any:
    return _shuffle(mask, value, lambda lane: lane + int(delta))


def shfl_xor_sync(self: Any, mask: int, value: Any, lane_mask: int) -> Any:
    return _shuffle(mask, value, lambda lane: lane ^ int(lane_mask))


def syncwarp(self: Any, mask: int = FULL_MASK) -> None:
    if int(mask) & FULL_MASK != FULL_MASK:
        raise NotImplementedError("the simulator shim supports only syncwarp() of the full warp")
    exchange, _, _ = _this_lane()
    exchange.barrier.wait()


_SHIMS = {
    "shfl_sync": shfl_sync,
    "shfl_up_sync": shfl_up_sync,
    "shfl_down_sync": shfl_down_sync,
    "shfl_xor_sync": shfl_xor_sync,
    "syncwarp": syncwarp,
}


def install() -> list[str]:
    """Add the missing warp intrinsics to the simulator; returns the names added (none off the simulator)."""
    if not simulator_enabled():
        return []
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    added = []
    for name, function in _SHIMS.items():
        if not hasattr(FakeCUDAModule, name):  # never replace what the simulator already provides
            setattr(FakeCUDAModule, name, function)
            added.append(name)
    return added


def as_f32(bits: Any) -> Any:
    """uint32 bits -> float32 (the simulator's stand-in for the kernels' bitcast intrinsic)."""
    import numpy as np

    return np.uint32(bits).view(np.float32)


def as_u32(value: Any) -> Any:
    """float32 -> its uint32 bits (the simulator's stand-in for the kernels' bitcast intrinsic)."""
    import numpy as np

    return np.float32(value).view(np.uint32)


def load16(row: Any, word: int) -> tuple[Any, Any]:
    """``(row[word], row[word + 1])``: the simulator's stand-in for the kernels' 16-byte load intrinsic."""
    return row[word], row[word + 1]


def loads_arrived(sink: Any) -> Any:
    """uint64 zero: the simulator's stand-in for the kernels' load-ordering intrinsic (no scheduling here)."""
    import numpy as np

    return np.uint64(0)
