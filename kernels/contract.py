"""The data contract every backend shares, and the one place its inputs are checked.

    x             [T, H]      bf16     activations of the T decode tokens
    w13           [E, 2I, H]  bf16     per expert: gate rows 0..I-1, then up rows I..2I-1
                                       (vLLM's ``w1`` / Hugging Face's ``gate_up_proj`` layout)
    w2            [E, H, I]   bf16     per expert: down projection
    topk_ids      [T, K]      int32    routed experts of each token (duplicates legal: contributions add)
    topk_weights  [T, K]      float32  routing weight of each (token, slot)
    out           [T, H]      bf16 (float32 on request)

    out[t] = sum_k topk_weights[t, k] * w2[e] @ (SiLU(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t])),  e = topk_ids[t, k]

H and I must be multiples of 8: the kernels load 16 bytes (8 bf16) per lane.

Arrays may be NumPy or CuPy (all of one kind). Checks that need the *values* of ``topk_ids`` and
``topk_weights`` (ids in range, weights finite) read them back; on a GPU that is a host sync, so they are
skipped while a CUDA graph is being captured, and the kernels instead guard every expert id (an
out-of-range id makes that token's output NaN, never an illegal access).

NaN and inf. The routing (``topk_ids``, ``topk_weights``) is control data: checked, as above. Activations and
weights are data: never inspected on the hot path (that would cost a pass over them and a host sync). A NaN or inf
in them propagates IEEE-style to exactly the outputs it feeds, in every path and in the reference
(``kernels.reference.moe_decode``, every mode): one in ``x[t]`` makes ``out[t]`` non-finite and leaves every other
token's row as it would be without it; one in expert e's weights reaches only the tokens routed to e (w13's: their
whole rows; ``w2[e, h, :]``'s: their column h). In the fp8-block128 formats a weight is value x block scale, so a
non-finite weight is a non-finite scale (its whole block); e4m3fn's NaN codes (0x7F, 0xFF) are not values these
formats hold -- the tensor-core paths widen them as +-480 -- and nothing here writes them. The offline constructors
refuse non-finite values, a ValueError naming the matrix and where: ``kernels.quantize_weights``
(:func:`check_weights`: a block scale cannot represent them) and ``kernels.fp8_experts_from_checkpoint`` (NaN codes,
non-finite scales).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
OUT_DTYPES = (BF16, np.dtype(np.float32))


@dataclass(frozen=True)
class Dims:
    """The sizes one call works on."""

    tokens: int  # T
    hidden: int  # H
    intermediate: int  # I
    experts: int  # E
    top_k: int  # K


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


def check_inputs(x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, *, check_values: bool = True,
                 weight_format: Any = "bf16") -> Dims:
    """Validate the five inputs of an MoE decode call against the contract; return their sizes.

    Raises ``TypeError`` for a wrong array kind or dtype and ``ValueError`` for a wrong shape or value,
    naming the argument and what was expected. ``check_values`` reads ``topk_ids`` / ``topk_weights``
    (skipped automatically during CUDA-graph capture). ``weight_format`` (a name or a
    ``kernels.formats.WeightFormat``) checks w13 / w2 as that format stores them; their values keep the layouts.
    """
    from kernels.formats import get_format

    xp = array_module(x)
    check_array("x", x, xp, BF16, 2, "[T, H]")
    fmt = get_format(weight_format)
    w13 = fmt.check("w13", w13, xp, "[E, 2I, H]")
    w2 = fmt.check("w2", w2, xp, "[E, H, I]")
    check_array("topk_ids", topk_ids, xp, np.dtype(np.int32), 2, "[T, K]")
    check_array("topk_weights", topk_weights, xp, np.dtype(np.float32), 2, "[T, K]")

    tokens = int(x.shape[0])
    if tokens < 1:
        raise ValueError(f"x must hold at least one token (T >= 1), got shape {tuple(x.shape)}")
    experts, hidden, intermediate = check_weight_dims(w13.shape, w2.shape, hidden=int(x.shape[1]))
    if int(topk_ids.shape[0]) != tokens:
        raise ValueError(f"topk_ids must be [T, K] with T = {tokens} (from x), got shape {tuple(topk_ids.shape)}")
    top_k = int(topk_ids.shape[1])
    if top_k < 1:
        raise ValueError(
            f"topk_ids must route each token to at least one expert (K >= 1), got shape {tuple(topk_ids.shape)}"
        )
    if tuple(int(d) for d in topk_weights.shape) != (tokens, top_k):
        raise ValueError(
            f"topk_weights must be [T, K] = [{tokens}, {top_k}] like topk_ids, got shape {tuple(topk_weights.shape)}"
        )

    if check_values and not (xp is not np and is_capturing()):
        low, high = int(topk_ids.min()), int(topk_ids.max())
        if low < 0 or high >= experts:
            raise ValueError(f"topk_ids must lie in [0, E) = [0, {experts}), found values in [{low}, {high}]")
        if not bool(xp.isfinite(topk_weights).all()):
            raise ValueError("topk_weights must be finite, found NaN or inf")
    return Dims(tokens, hidden, intermediate, experts, top_k)


def check_weight_dims(w13_shape: Any, w2_shape: Any, hidden: int | None = None) -> tuple[int, int, int]:
    """``(E, H, I)`` of w13 [E, 2I, H] and w2 [E, H, I] given their shapes; a ValueError naming the argument and the
    shape expected unless E >= 1, w13's 2I is even, w2 matches w13 and H and I are multiples of 8. ``hidden``: H as
    x says (:func:`check_inputs`); without it (weights alone, :func:`check_weights`) w13's last dimension is H."""
    w13_shape, w2_shape = tuple(int(d) for d in w13_shape), tuple(int(d) for d in w2_shape)
    experts, two_i, w13_hidden = w13_shape
    from_x = hidden is not None
    if experts < 1:
        raise ValueError(f"w13 must hold at least one expert (E >= 1), got shape {w13_shape}")
    if from_x and w13_hidden != hidden:
        raise ValueError(f"w13 is [E, 2I, H] with H = {hidden} (from x), got shape {w13_shape}")
    hidden = w13_hidden
    if two_i < 2 or two_i % 2:
        raise ValueError(f"w13's second dimension is 2I (gate then up rows), must be even, got {two_i}")
    intermediate = two_i // 2
    if w2_shape != (experts, hidden, intermediate):
        # w13 given w2's [E, H, I] and w2 given w13's [E, 2I, H]
        swapped = len(w2_shape) == 3 and w2_shape[1] == 2 * w13_shape[2] and w2_shape[2] == w13_shape[1]
        raise ValueError(
            f"w2 must be [E, H, I] = [{experts}, {hidden}, {intermediate}] to match "
            + ("w13 and x" if from_x else f"w13 [E, 2I, H] = {list(w13_shape)}")
            + f", got shape {w2_shape}" + (" (w13 and w2 swapped?)" if swapped else "")
        )
    for dim, value, where in (("H", hidden, "x.shape[1]"), ("I", intermediate, "w2.shape[2]")):
        if value % 8 and from_x:
            raise ValueError(f"{dim} ({where}) must be a multiple of 8 for 16-byte loads, got {value}")
        if value % 8:
            raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I] with {dim} a multiple of 8 (16-byte loads), "
                             f"got {dim} = {value}: w13 {w13_shape}, w2 {w2_shape}")
    return experts, hidden, intermediate


def check_weights(w13: Any, w2: Any, weight_format: Any = "bf16") -> tuple[int, int, int]:
    """Check weights in the contract's layouts before they are converted offline into ``weight_format``
    (``kernels.quantize_weights``); return ``(E, H, I)``.

    w13 [E, 2I, H] and w2 [E, H, I] must be float32 or bf16 (any float) arrays of one kind, NumPy or CuPy, with the
    dims of :func:`check_weight_dims` and those the format stores (``WeightFormat.check_dims``: a tiled format's whole
    tiles), and every value finite: a NaN or inf is a ValueError naming the matrix, the experts holding them and the
    first one's index. A block scale cannot represent them (unchecked, a NaN left its fp8-block128 block unscaled and
    an inf zeroed the rest of it), and an offline conversion is where a corrupt weight costs least to catch. The
    finiteness pass reads every value once, an expert at a time; on CuPy it reads one count back to the host.
    """
    from kernels.formats import get_format

    fmt = get_format(weight_format)
    xp = None
    for name, w in (("w13", w13), ("w2", w2)):
        dtype = getattr(w, "dtype", None)
        if dtype is None or not (dtype == BF16 or np.dtype(dtype).kind == "f"):
            raise TypeError(f"{name} must be a float32 or bfloat16 array, got {type(w).__name__} of {dtype}")
        module = array_module(w)
        if xp is not None and module is not xp:
            raise TypeError(f"w2 must be a {xp.__name__} array like w13, got {type(w).__module__}.{type(w).__name__}")
        xp = module
        if w.ndim != 3:
            want = "[E, 2I, H]" if name == "w13" else "[E, H, I]"
            raise ValueError(f"{name} must have 3 dimensions {want}, got shape {tuple(w.shape)}")
    experts, hidden, intermediate = check_weight_dims(w13.shape, w2.shape)
    fmt.check_dims(hidden, intermediate, f"w13 [E, 2I, H] = {list(w13.shape)}, w2 [E, H, I] = {list(w2.shape)}")
    for name, w in (("w13", w13), ("w2", w2)):
        _check_finite(name, w, fmt.name)
    return experts, hidden, intermediate


def _check_finite(name: str, w: Any, target: str) -> None:
    """ValueError unless every value of ``w`` [E, R, C] is finite (one expert at a time: bounded temporaries)."""
    xp = array_module(w)
    counts = xp.zeros(int(w.shape[0]), np.int64)
    for e in range(int(w.shape[0])):
        m = w[e]
        bad = (m.view(np.uint16) & 0x7F80) == 0x7F80 if m.dtype == BF16 else ~xp.isfinite(m)
        counts[e] = xp.count_nonzero(bad)
    if not int(counts.sum()):
        return
    counts = counts.get() if xp is not np else counts
    experts = np.flatnonzero(counts)
    first = int(experts[0])
    m = w[first]
    host = (m.get() if xp is not np else m).astype(np.float32)
    row, col = (int(i) for i in np.argwhere(~np.isfinite(host))[0])
    listed = ", ".join(f"{int(e)} ({int(counts[e])})" for e in experts[:8]) + (", ..." if len(experts) > 8 else "")
    raise ValueError(f"{name} must be finite to become {target} weights: {int(counts.sum())} NaN/inf values in "
                     f"{len(experts)} of {len(counts)} experts (expert (count): {listed}); the first is "
                     f"{name}[{first}, {row}, {col}] = {host[row, col]}")


def check_out(out: Any, dims: Dims, xp: Any, name: str = "out") -> None:
    """``out`` must be a contiguous [T, H] bf16 or float32 array of the inputs' kind."""
    if array_module(out) is not xp:
        raise TypeError(f"{name} must be a {xp.__name__} array like x")
    if tuple(int(d) for d in out.shape) != (dims.tokens, dims.hidden):
        raise ValueError(f"{name} must be [T, H] = [{dims.tokens}, {dims.hidden}], got shape {tuple(out.shape)}")
    if out.dtype not in OUT_DTYPES:
        raise TypeError(f"{name} must have dtype bfloat16 or float32, got {out.dtype}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def check_out_dtype(out_dtype: Any) -> np.dtype:
    """Normalise an ``out_dtype`` argument to bf16 or float32."""
    try:
        dtype = np.dtype(out_dtype)
    except TypeError:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {out_dtype!r}") from None
    if dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be bfloat16 or float32, got {dtype}")
    return dtype
