"""Arrays as the kernels take them: the element types, which module owns an array (NumPy or CuPy), and the checks of
one argument -- an int, an array module, one array's kind, dtype, rank and layout, its alignment.

The bottom of the library: it imports NumPy and ml_dtypes and nothing of the project's, so any module can build on it.
:mod:`kernels.contract` re-exports every name here (``from kernels.contract import BF16`` is the usual spelling);
the modules the contract itself builds on (:mod:`kernels.shapes`, :mod:`kernels.formats`) import them from here.
"""

from __future__ import annotations

import types
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def check_int(name: str, value: object, minimum: int = 0, maximum: int | None = None) -> int:
    """``value`` as a Python int: a Python or NumPy integer (never a bool, never a float) in [minimum, maximum].

    TypeError for a non-integer, ValueError for one out of range; both name the argument.
    """
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {value!r}")
    number = int(value)
    if maximum is not None and not minimum <= number <= maximum:
        raise ValueError(f"{name} must be an int in [{minimum}, {maximum}], got {number}")
    if number < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {number}")
    return number


def check_xp(xp: Any, name: str = "xp") -> Any:
    """The array module ``xp`` names: ``numpy`` / ``cupy`` (the modules, or those strings).

    TypeError for anything else. For CuPy, a ValueError unless it sees a CUDA GPU, checked with one guarded
    ``getDeviceCount()`` before any other CUDA call (so a machine without a GPU gets a sentence, not a CUDA error).
    """
    if isinstance(xp, str):
        if xp == "numpy":
            return np
        if xp != "cupy":
            raise TypeError(f"{name} must be the numpy or cupy module (or 'numpy' / 'cupy'), got {xp!r}")
        try:
            import cupy as module
        except Exception as exc:  # noqa: BLE001 - not installed / broken install: no GPU for us
            raise ValueError(f"{name}=cupy needs a CUDA GPU (cupy cannot be imported: {_one_line(exc)})") from None
    elif xp is np:
        return np
    elif isinstance(xp, types.ModuleType) and xp.__name__ == "cupy":
        module = xp
    else:
        what = f"module {xp.__name__!r}" if isinstance(xp, types.ModuleType) else f"{type(xp).__name__} {xp!r:.60}"
        raise TypeError(f"{name} must be the numpy or cupy module (or 'numpy' / 'cupy'), got {what}")
    try:
        count = int(module.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - no driver / no device / no CUDA runtime
        raise ValueError(f"{name}=cupy needs a CUDA GPU ({_one_line(exc)})") from None
    if count < 1:
        raise ValueError(f"{name}=cupy needs a CUDA GPU (no CUDA device found)")
    return module


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def array_module(arr: Any) -> Any:
    """``numpy`` or ``cupy``, whichever owns ``arr``; anything else is a TypeError."""
    if isinstance(arr, np.ndarray):
        return np
    if type(arr).__module__.startswith("cupy"):
        import cupy

        return cupy
    raise TypeError(f"expected a numpy.ndarray or cupy.ndarray, got {type(arr).__name__}")


def require_cupy(**arrays: Any) -> Any:
    """TypeError unless every array is a CuPy array (the GPU backends); returns the ``cupy`` module."""
    for name, arr in arrays.items():
        if not type(arr).__module__.startswith("cupy"):
            raise TypeError(
                f"{name} must be a cupy.ndarray (the cupy backend runs on the GPU), "
                f"got {type(arr).__module__}.{type(arr).__name__}"
            )
    import cupy

    return cupy


def check_aligned(**arrays: Any) -> None:
    """ValueError unless every array starts on a 16-byte boundary (the kernels' 16-byte vector loads)."""
    for name, arr in arrays.items():
        if int(arr.data.ptr) % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary (16-byte loads), got address {arr.data.ptr:#x}")


def is_capturing() -> bool:
    """True while the current CuPy stream is being captured into a CUDA graph."""
    try:
        import cupy
    except ImportError:  # pragma: no cover - cupy is a dependency
        return False
    stream = cupy.cuda.get_current_stream()
    try:
        return bool(stream.is_capturing())
    except Exception:  # noqa: BLE001 - older CuPy / no device: not capturing
        return False


def check_array(name: str, arr: Any, xp: Any, dtype: np.dtype, ndim: int, what: str) -> None:
    """``arr`` must be an ``xp`` array of ``dtype`` with ``ndim`` dimensions (``what``), C-contiguous."""
    if not hasattr(arr, "dtype") or array_module(arr) is not xp:
        raise TypeError(f"{name} must be a {xp.__name__} array like x, got {type(arr).__module__}.{type(arr).__name__}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {what}, got shape {tuple(arr.shape)}")
    if arr.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype.name}, got {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (call .copy() or ascontiguousarray first)")
