"""A new weight format for the batched kernels is one WeightFormat and one loader -- no kernel edit.

The toy format ``toy-pairswap`` stores bf16 values with each pair of neighbours along k swapped (the two halves of
every 32-bit word exchanged): data (:class:`PairSwapped`, quantize / dequantize in NumPy) plus a loader whose
device code swaps them back while widening. Every batched family then compiles for it as it is (offline, sm_90),
and gives bitwise the outputs it gives on the same values in bf16: in the g++ emulation (the FMA and tensor-core
families) and on a GPU (all three).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from kernels import batched
from kernels.batched import loaders
from kernels.batched.common import FormatFamilies
from kernels.compile import SOURCES, offline_compile
from kernels.contract import BF16, Dims
from kernels.formats import FORMATS, Bf16T16, Quantized, get_format

NAME = "toy-pairswap"


def swap_pairs(values: Any) -> Any:
    """Exchange the values 2j and 2j + 1 of every row (an involution)."""
    shape = values.shape
    return values.reshape(*shape[:-1], shape[-1] // 2, 2)[..., ::-1].reshape(shape).copy()


@dataclasses.dataclass(frozen=True)
class PairSwapped(Bf16T16):
    """bf16 values, neighbours along k swapped; no scales."""

    layout: str = "pairswap"

    def from_rows(self, w13: Any, w2: Any) -> tuple[Quantized, Quantized]:
        return Quantized(swap_pairs(w13), None, self.layout), Quantized(swap_pairs(w2), None, self.layout)

    def dequantize(self, weights: Any, matrix: str) -> np.ndarray:
        values = weights.values.get() if hasattr(weights.values, "get") else weights.values
        return swap_pairs(values).astype(np.float32)

    def expert(self, weights: Any, expert: int, matrix: str) -> np.ndarray:
        values = weights.values[expert:expert + 1]
        return swap_pairs(values.get() if hasattr(values, "get") else values)[0]

    def expert_here(self, weights: Any, expert: int, matrix: str) -> Any:
        return swap_pairs(weights.values[expert:expert + 1])[0]


TOY = PairSwapped(NAME, "bf16 with neighbouring values along k swapped (a test format)", 2)

SWAP = r"""
__device__ __forceinline__ u32 swap_halves(u32 w) { return (w >> 16) | (w << 16); }
"""
FMA_LOADER = SWAP + r"""
typedef bf16_t weight_t;
#define VALUES_PER_WEIGHT 1
#define WEIGHT_CHUNK_BYTES(act_bytes) (act_bytes)
template <typename W>
__device__ __forceinline__ void weight_pair(const W& wv, int w, float scale, float& lo, float& hi) {
    (void)scale;
    lo = bf16_lo(swap_halves(word(wv, w)));
    hi = bf16_hi(swap_halves(word(wv, w)));
}
""" + loaders.FMA_NO_SCALES
MMA_LOADER = SWAP + r"""
typedef bf16_t weight_t;
#define VALUES_PER_WEIGHT 1
typedef uint4 a_chunk_t;
typedef uint4 a_load_t;
#define MMA_HALVES 1
#define FORMAT_WHOLE_ROUNDS 0
__device__ __forceinline__ uint4 a_fragment(const uint4& v, int h) {
    (void)h;
    return make_uint4(swap_halves(v.x), swap_halves(v.y), swap_halves(v.z), swap_halves(v.w));
}
template <bool PRE_SCALED_B = false>
__device__ __forceinline__ uint4 b_fragment(const uint4& v) { return v; }
__device__ __forceinline__ bf16_t intermediate_value(float v) { return f32_to_bf16(v); }
""" + loaders.ROW_ADDRESSING + loaders.NO_SCALES

PATHS = ("fma", "mma", "pairs")
DIMS = Dims(5, 64, 48, 6, 2)


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> PairSwapped:
    """The toy format and its loader registered for one test (the families built for it forgotten after)."""
    monkeypatch.setitem(FORMATS, NAME, TOY)
    monkeypatch.setitem(loaders.LOADERS, NAME, loaders.Loader(NAME, FMA_LOADER, MMA_LOADER))
    for families in batched.FAMILIES.values():
        monkeypatch.setattr(families, "_families", dict(families._families))
    for kind in ("fma", "mma", "pairs"):
        monkeypatch.setitem(SOURCES, f"batched_{kind}[{NAME}]", None)  # undone: the toy sources leave the registry
    return TOY


def _weights(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    d = DIMS
    w13 = (rng.standard_normal((d.experts, 2 * d.intermediate, d.hidden)) * 0.05).astype(BF16)
    w2 = (rng.standard_normal((d.experts, d.hidden, d.intermediate)) * 0.05).astype(BF16)
    return w13, w2


def test_toy_format_round_trips_and_the_reference_reads_it(toy: PairSwapped) -> None:
    from kernels.reference import moe_decode

    w13, w2 = _weights()
    t13, t2 = toy.quantize(w13, w2)
    assert get_format(NAME) is toy and not toy.scaled and not toy.tiled
    np.testing.assert_array_equal(toy.dequantize(t13, "w13"), w13.astype(np.float32))
    assert not np.array_equal(t13.values, w13)  # it is stored differently
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((DIMS.tokens, DIMS.hidden))).astype(BF16)
    ids = np.stack([rng.choice(DIMS.experts, DIMS.top_k, replace=False) for _ in range(DIMS.tokens)]).astype(np.int32)
    weights = rng.random((DIMS.tokens, DIMS.top_k)).astype(np.float32)
    ref = moe_decode(x, w13, w2, ids, weights, mode="warp_decode")
    np.testing.assert_array_equal(moe_decode(x, t13, t2, ids, weights, mode="warp_decode"), ref)


@pytest.mark.parametrize("path", PATHS)
def test_toy_format_compiles_in_every_family_without_a_kernel_edit(toy: PairSwapped, path: str) -> None:
    """The family's text on the toy format is its bf16 text with the loader exchanged, and it compiles for sm_90."""
    family = batched.family(path, NAME)
    reference = batched.family(path, "bf16")
    kind = "fma" if path == "fma" else "mma"
    bf16_loader = loaders.loader_for("bf16", kind)
    toy_loader = MMA_LOADER if kind == "mma" else FMA_LOADER
    assert family.source.code == reference.source.code.replace(bf16_loader, toy_loader)
    params = family.resolve(DIMS)
    kernels = family.kernel_names(params) if family.kernel_names else family.source.compiled_kernels(**params)
    cubin, log = offline_compile(family.source.render(**params))
    assert cubin and all(f"'{name}'" in log or name in log for name in kernels)


@pytest.mark.parametrize("path", ["fma", "mma"])
def test_toy_format_emulated_is_bitwise_the_bf16_path(toy: PairSwapped, path: str) -> None:
    """The family's CUDA C with the toy loader, run by the g++ emulation, gives bitwise what it gives on bf16 rows
    (intermediate and out): the loader undoes the layout exactly, the kernels do the rest unchanged."""
    from kernels.problem import make_problem
    from kernels.shapes import MoEShape
    from tests.test_warp_decode_batched import _emulate

    problem = make_problem(MoEShape("toy-h64-i48", DIMS.hidden, DIMS.intermediate, DIMS.experts, DIMS.top_k),
                           DIMS.tokens, seed=5, routing="zipf")
    t13, t2 = toy.quantize(problem.w13, problem.w2)
    want = _emulate(problem, path=path)
    got = _emulate(dataclasses.replace(problem, w13=t13, w2=t2), path=path)
    assert np.array_equal(got["inter"], want["inter"]) and np.isfinite(want["out"].astype(np.float32)).all()
    assert np.array_equal(got["out"].view(np.uint16), want["out"].view(np.uint16))


def test_format_families_are_built_on_first_use(toy: PairSwapped) -> None:
    assert isinstance(batched.FAMILIES["mma"], FormatFamilies)
    assert NAME not in batched.FAMILIES["mma"].families
    family = batched.family("mma", NAME)
    assert batched.family("mma", NAME) is family and family.name == f"warp-decode-mma[{NAME}]"
    with pytest.raises(ValueError, match="no fma loader for weight format 'bf16-t16'"):
        batched.family("fma", "bf16-t16")


@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
def test_toy_format_on_the_gpu_is_bitwise_the_bf16_path(toy: PairSwapped, path: str) -> None:
    cupy = pytest.importorskip("cupy")
    w13, w2 = _weights(2)
    t13, t2 = toy.quantize(w13, w2)
    rng = np.random.default_rng(3)
    x = cupy.asarray(rng.standard_normal((DIMS.tokens, DIMS.hidden)).astype(BF16))
    ids = cupy.asarray(np.stack([rng.choice(DIMS.experts, DIMS.top_k, replace=False)
                                 for _ in range(DIMS.tokens)]).astype(np.int32))
    weights = cupy.asarray(rng.random((DIMS.tokens, DIMS.top_k)).astype(np.float32))
    on_gpu = [cupy.asarray(w) for w in (w13, w2)]
    toy_gpu = [Quantized(cupy.asarray(w.values), None, w.layout) for w in (t13, t2)]
    want = batched.warp_decode_batched(x, *on_gpu, ids, weights, path=path)
    out = cupy.full((DIMS.tokens, DIMS.hidden), np.nan, dtype=BF16)  # poisoned: every element must be written
    got = batched.warp_decode_batched(x, *toy_gpu, ids, weights, out=out, path=path)
    np.testing.assert_array_equal(cupy.asnumpy(got).view(np.uint16), cupy.asnumpy(want).view(np.uint16))
