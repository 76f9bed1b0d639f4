"""Weight formats as data: bytes per expert, quantize / dequantize, and the bench's bytes accounting."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.contract import BF16
from kernels.formats import BF16_FORMAT, FORMATS, Quantized, WeightFormat, get_format
from kernels.routing import make_routing
from kernels.shapes import PRESETS
from tools import harness


@pytest.mark.parametrize("model", ["tiny", "qwen3-30b-a3b", "deepseek-v3"])
def test_bf16_bytes_are_the_contract_bytes(model: str) -> None:
    shape = PRESETS[model]
    assert BF16_FORMAT.expert_bytes(shape.hidden, shape.intermediate) == shape.expert_bytes
    assert BF16_FORMAT.scale_bytes(shape.hidden, shape.intermediate) == 0


def test_bf16_quantize_rounds_to_nearest_even_and_reads_back(rng: np.random.Generator) -> None:
    w13 = rng.standard_normal((3, 16, 24), dtype=np.float32)
    w2 = rng.standard_normal((3, 24, 8), dtype=np.float32)
    q13, q2 = BF16_FORMAT.quantize(w13, w2)
    assert q13.dtype == BF16 and q2.dtype == BF16
    assert np.array_equal(q13.view(np.uint16), w13.astype(BF16).view(np.uint16))
    back = BF16_FORMAT.dequantize(q13)
    assert back.dtype == np.float32 and np.max(np.abs(back - w13) / np.abs(w13)) <= 2.0**-8
    assert BF16_FORMAT.quantize(q13, q2)[0] is q13  # already bf16: unchanged
    with pytest.raises(TypeError, match="w2 must be a float32 or bfloat16 array"):
        BF16_FORMAT.quantize(w13, w2.astype(np.int32))


def test_lookup() -> None:
    assert get_format("bf16") is BF16_FORMAT and get_format(BF16_FORMAT) is BF16_FORMAT
    assert set(FORMATS) >= {"bf16"} and all(isinstance(f, WeightFormat) for f in FORMATS.values())
    with pytest.raises(ValueError, match="unknown weight_format 'int3'; known: bf16"):
        get_format("int3")
    with pytest.raises(TypeError, match="weight_format must be"):
        get_format(8)


def test_bench_bytes_follow_the_format() -> None:
    """A scaled format's TB/s counts its values and its scales: the bytes it reads."""

    class Halves(WeightFormat):
        def scale_bytes(self, hidden: int, intermediate: int) -> int:
            return 4 * (hidden // 8)

    shape = PRESETS["tiny"]
    ids, _ = make_routing(4, shape.experts, shape.top_k, "uniform", 0)
    plain = harness.bytes_breakdown(shape, ids)
    half = harness.bytes_breakdown(shape, ids, Halves("halves", "1 byte a value, a scale per 8 rows", 1))
    unique = plain["unique_experts"]
    assert plain["weight_format"] == "bf16" and plain["weights"] == unique * shape.expert_bytes
    assert half["weight_format"] == "halves"
    assert half["weights"] == unique * (3 * shape.hidden * shape.intermediate + 4 * (shape.hidden // 8))
    assert half["activation"] == plain["activation"]


def test_variants_default_to_bf16() -> None:
    from kernels.variants import load_builtin

    assert {v.weight_format for v in load_builtin().values()} == {"bf16"}


class ExpertScaled(WeightFormat):
    """A toy scaled format (one power-of-two float32 scale per expert and matrix, bf16 values): what adding a format
    takes -- this class -- and, because its values times its scales are exact in bf16, a format whose reference
    must equal the bf16 reference on its dequantized weights bit for bit."""

    def scale_bytes(self, hidden: int, intermediate: int) -> int:
        return 2 * 4

    def quantize(self, w13: np.ndarray, w2: np.ndarray) -> tuple[Quantized, Quantized]:
        def one(w: np.ndarray) -> Quantized:
            amax = np.abs(w.astype(np.float32)).max(axis=(1, 2))
            scales = np.exp2(np.ceil(np.log2(amax))).astype(np.float32)
            return Quantized((w.astype(np.float32) / scales[:, None, None]).astype(BF16), scales)

        return one(w13), one(w2)

    def dequantize(self, weights: Quantized) -> np.ndarray:
        return weights.values.astype(np.float32) * weights.scales[:, None, None]


def test_reference_reads_weights_through_their_format() -> None:
    from kernels.problem import make_problem
    from kernels.reference import moe_decode

    problem = make_problem("tiny", 5, routing="uniform", seed=3)
    fmt = ExpertScaled("expert-scaled", "bf16 values, one scale per expert", 2)
    q13, q2 = fmt.quantize(problem.w13, problem.w2)
    assert not np.array_equal(q13.values.view(np.uint16), problem.w13.view(np.uint16))  # really scaled
    d13, d2 = fmt.dequantize(q13).astype(BF16), fmt.dequantize(q2).astype(BF16)
    assert np.array_equal(d13.astype(np.float32), fmt.dequantize(q13))  # exact in bf16
    x, ids, wts = problem.x, problem.topk_ids, problem.topk_weights
    for mode, quant in (("fp64", None), ("warp_decode", None), ("classical", None), ("classical", "fp8")):
        via_format = moe_decode(x, q13, q2, ids, wts, mode=mode, quant=quant, weight_format=fmt)
        plain = moe_decode(x, d13, d2, ids, wts, mode=mode, quant=quant)
        assert np.array_equal(via_format.view(np.uint8), plain.view(np.uint8)), mode
    with pytest.raises(TypeError, match="w13 must be expert-scaled weights"):
        moe_decode(x, problem.w13, q2, ids, wts, weight_format=fmt)
    with pytest.raises(TypeError, match="w2 must be a numpy array like x, got kernels.formats.Quantized"):
        moe_decode(x, problem.w13, q2, ids, wts)
    with pytest.raises(ValueError, match="w13.values must have 3 dimensions"):
        moe_decode(x, Quantized(q13.values[0], q13.scales), q2, ids, wts, weight_format=fmt)
