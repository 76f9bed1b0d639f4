"""The GPU as the tools meet it around a measurement: whether CuPy sees a device (and, when not, what is missing:
CuPy, the driver, a GPU, a recent enough driver), and a CUDA graph of a callable's launches.

Imports nothing of the project's, and CuPy only when called: ``tools.harness`` (whose ``gpu_available`` the
programs call) and ``tools.roofline`` both build on it, and neither imports the other.
"""

from __future__ import annotations

import contextlib
from typing import Any


def _cuda_driver_version() -> int | None:
    """The CUDA driver's version (e.g. 12080), or None where no driver library can be loaded."""
    import ctypes

    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int(0)
        return int(version.value) if library.cuDriverGetVersion(ctypes.byref(version)) == 0 else 0
    return None


def _why_no_device(cupy: Any, error: Exception) -> str:
    """What CuPy's failure to count devices means: no driver, no GPU, or a driver too old for its runtime."""
    driver = _cuda_driver_version()
    if driver is None:
        return "no CUDA driver (libcuda not found)"
    text = str(error)
    if "NoDevice" in text or "no CUDA-capable device" in text:
        return "no GPU (the CUDA driver sees none)"
    if "InsufficientDriver" in text:
        try:
            runtime = cupy.cuda.runtime.runtimeGetVersion()
        except Exception:  # noqa: BLE001
            runtime = "?"
        return f"the CUDA driver ({driver}) is older than CuPy's CUDA runtime ({runtime})"
    return f"CUDA error: {type(error).__name__}: {text}"


def gpu_available() -> tuple[bool, str]:
    """``(True, "N device(s)")`` when CuPy sees a CUDA device, else ``(False, what is missing)``: CuPy, the CUDA
    driver, a GPU, or a driver recent enough for CuPy's CUDA runtime. Never raises; no numba import."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - not installed, or a broken install
        return False, f"CuPy cannot be imported ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - the runtime's error: say what is missing
        return False, _why_no_device(cupy, exc)
    if count < 1:
        return False, "no GPU (the CUDA driver sees none)"
    return True, f"{count} device(s)"


def capture(stream: Any, fn: Any) -> Any:
    """``fn()``'s launches on ``stream`` captured as a CUDA graph. The capture ends even when ``fn`` raises, and then
    ``fn``'s error is the one raised: ending a capture that the error invalidated raises only
    cudaErrorStreamCaptureInvalidated, which says nothing of the cause."""
    stream.begin_capture()
    try:
        with stream:
            fn()
    except BaseException:
        with contextlib.suppress(Exception):
            stream.end_capture()
        raise
    return stream.end_capture()
