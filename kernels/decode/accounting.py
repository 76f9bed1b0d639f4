"""What one decode step must read, per block and per launch: the bytes a step's time is divided by.

A step (:mod:`kernels.decode.step`) is, in launch order: the embedding gather; per layer the QKV GEMV (residual add
and RMSNorm in its prologue), q/k norm + RoPE + KV append, decode attention, the O GEMV (residual in its epilogue),
the fused router (the post-attention norm in its prologue) and the MoE's launches; then the LM head GEMV (final norm
in, argmax out) and the lengths bump. :data:`BLOCKS` groups them as the report does.

Bytes are what must come from HBM: weights (bf16, or fp8-block128 values and scales where the format quantizes the
matrix), the KV cache read (every valid position of every sequence, this token's included) and written (this token's
K and V), the touched experts (each once: the expected distinct count E (1 - (1 - K/E)^T) under uniform routing, or
a measured count), the LM head, the embedding rows gathered. Activations between kernels ([T, H]-sized, L2 resident)
are not counted. At qwen3-30b-a3b, T = 1, C = 2048, bf16 this is 6.28 GB (48 x [QKV + O 37.7 MB + router 0.5 MB +
KV 4.2 MB + 8 experts 75.5 MB] + LM head 622 MB), the figure of issue #59.

fp8-block128 (as FP8 checkpoints ship): q/k/v/o projections and the experts quantized in 128 x 128 blocks (e4m3
values, a float32 scale per block); the embedding, norms, router (``mlp.gate``) and LM head stay bf16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kernels.arrays import check_int
from kernels.formats import get_format
from kernels.geometry import BLOCK
from kernels.shapes import BF16_BYTES, MoEShape, get_shape

ATTENTION_PROJECTIONS = "attention projections"
ATTENTION = "attention"
ROUTER = "router"
MOE = "moe"
LM_HEAD = "lm head"
OTHER = "norms/other"
BLOCKS = (ATTENTION_PROJECTIONS, ATTENTION, ROUTER, MOE, LM_HEAD, OTHER)
WEIGHT_FORMATS = ("bf16", "fp8-block128")
FP8_MATRICES = ("wqkv", "wo")  # the dense matrices fp8-block128 quantizes (besides the experts)


def check_step_format(weight_format: object) -> str:
    """``weight_format`` if a step can run it (:data:`WEIGHT_FORMATS`), else ValueError naming the allowed ones."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {WEIGHT_FORMATS} for a decode step, got {weight_format!r}")
    return str(weight_format)


def dense_bytes(rows: int, cols: int, weight_format: str = "bf16") -> int:
    """Bytes of a dense [rows, cols] matrix: bf16, or fp8-block128 (a byte a value + a float32 scale per 128 x 128
    block)."""
    if check_step_format(weight_format) == "bf16":
        return rows * cols * BF16_BYTES
    return rows * cols + 4 * (-(-rows // BLOCK)) * (-(-cols // BLOCK))


def qkv_rows(shape: MoEShape) -> int:
    """Rows of the stacked QKV projection: (heads + 2 kv_heads) * head_dim."""
    return (shape.num_attention_heads + 2 * shape.num_key_value_heads) * shape.head_dim


def _decoder(shape: str | MoEShape) -> MoEShape:
    shape = get_shape(shape)
    if not shape.has_attention:
        raise ValueError(f"preset {shape.name!r} has no decoder fields: a decode step needs heads, KV heads, head "
                         "dim, rope theta, vocab and eps (qwen3-30b-a3b, qwen3-235b-a22b, tiny carry them)")
    return shape


def expected_unique(shape: MoEShape, tokens: int) -> float:
    """Expected distinct experts one layer touches for ``tokens`` tokens under uniform routing: E (1 - (1 - K/E)^T)."""
    return shape.expected_unique_experts(tokens)


def _per_layer_unique(shape: MoEShape, tokens: int, unique_experts: float | Sequence[float] | None,
                      layers: int) -> list[float]:
    if unique_experts is None:
        return [expected_unique(shape, tokens)] * layers
    if isinstance(unique_experts, int | float):
        values = [float(unique_experts)] * layers
    else:
        values = [float(u) for u in unique_experts]
        if len(values) != layers:
            raise ValueError(f"unique_experts must hold one count per layer ({layers}), got {len(values)}")
    most = min(shape.experts, tokens * shape.top_k)
    if any(not 0 < u <= most for u in values):
        raise ValueError(f"unique_experts must lie in (0, min(E, T*K)] = (0, {most}], got {unique_experts!r}")
    return values


@dataclass(frozen=True)
class StepBytes:
    """What one step reads (and writes, the KV append), per block; ``per_layer`` the layer's part of each."""

    model: str
    tokens: int
    context: int
    weight_format: str
    layers: int
    blocks: dict[str, float]
    detail: dict[str, float]

    @property
    def total(self) -> float:
        return float(sum(self.blocks.values()))

    def as_dict(self) -> dict[str, object]:
        return {"model": self.model, "tokens": self.tokens, "context": self.context,
                "weight_format": self.weight_format, "layers": self.layers, "blocks": dict(self.blocks),
                "detail": dict(self.detail), "total": self.total}


def step_bytes(shape: str | MoEShape, tokens: int, context: int, weight_format: str = "bf16",
               unique_experts: float | Sequence[float] | None = None, layers: int | None = None) -> StepBytes:
    """The bytes of one decode step of ``tokens`` sequences, each with ``context`` positions in its cache before the
    step (attention reads context + 1), per block of :data:`BLOCKS`.

    ``unique_experts``: the distinct experts each layer touches (one number for every layer, or one per layer: the
    measured routing's count); default the expectation under uniform routing. ``layers``: the step's layers
    (default the preset's)."""
    shape = _decoder(shape)
    tokens = check_int("tokens", tokens, 1)
    context = check_int("context", context, 0)
    weight_format = check_step_format(weight_format)
    layers = shape.layers if layers is None else check_int("layers", layers, 1)
    H, kv, D = shape.hidden, shape.num_key_value_heads, shape.head_dim
    q_width = shape.num_attention_heads * D
    qkv = dense_bytes(qkv_rows(shape), H, weight_format)
    o = dense_bytes(H, q_width, weight_format)
    kv_position = 2 * kv * D * BF16_BYTES  # K and V of one position, one layer
    kv_read = tokens * (context + 1) * kv_position
    kv_write = tokens * kv_position
    router = shape.router_bytes
    expert = get_format(weight_format).expert_bytes(H, shape.intermediate)
    unique = _per_layer_unique(shape, tokens, unique_experts, layers)
    lm_head = shape.lm_head_bytes
    embed = tokens * H * BF16_BYTES
    blocks = {
        ATTENTION_PROJECTIONS: float(layers * (qkv + o)),
        ATTENTION: float(layers * (kv_read + kv_write)),
        ROUTER: float(layers * router),
        MOE: float(sum(unique) * expert),
        LM_HEAD: float(lm_head),
        OTHER: float(embed),
    }
    detail = {"qkv_weights": float(qkv), "o_weights": float(o), "kv_read": float(kv_read),
              "kv_write": float(kv_write), "router_weights": float(router), "expert_bytes": float(expert),
              "unique_experts_mean": sum(unique) / layers, "lm_head_weights": float(lm_head),
              "embedding_rows": float(embed)}
    return StepBytes(shape.name, tokens, context, weight_format, layers, blocks, detail)


# -- the launches, in order (the step's and the read floor's) ------------------------------------------------------
@dataclass(frozen=True)
class PlannedLaunch:
    """One kernel of the step: its block, its name, the layer (-1 outside the layers) and the bytes it reads."""

    block: str
    kernel: str
    layer: int
    nbytes: float


def moe_stage_bytes(stage_names: Sequence[str], layer_bytes: float) -> list[float]:
    """A layer's expert bytes split over the MoE's launches: gate/up stages 2/3, down stages 1/3 (w13 is 2I x H, w2
    H x I); stages that read no weights (align, lists, SiLU, sum) 0. Names that say neither: an even split."""
    if not stage_names:
        raise ValueError("the MoE must have at least one launch")
    gate_up = [i for i, n in enumerate(stage_names) if "gate_up" in n]
    down = [i for i, n in enumerate(stage_names) if "down" in n and i not in gate_up]
    if not gate_up or not down:
        return [layer_bytes / len(stage_names)] * len(stage_names)
    out = [0.0] * len(stage_names)
    for i in gate_up:
        out[i] = layer_bytes * 2 / 3 / len(gate_up)
    for i in down:
        out[i] = layer_bytes / 3 / len(down)
    return out


def launch_plan(shape: str | MoEShape, tokens: int, context: int, moe_stages: Sequence[str],
                weight_format: str = "bf16", unique_experts: float | Sequence[float] | None = None,
                layers: int | None = None) -> list[PlannedLaunch]:
    """Every launch of one step in order, with its block and bytes (summing per block to :func:`step_bytes`):
    what the step builds and what the read floor mirrors kernel for kernel. ``moe_stages``: the MoE path's launch
    names per layer (strict warp decode: gate_up, down)."""
    shape = _decoder(shape)
    sb = step_bytes(shape, tokens, context, weight_format, unique_experts, layers)
    d = sb.detail
    unique = _per_layer_unique(shape, tokens, unique_experts, sb.layers)
    plan = [PlannedLaunch(OTHER, "embed", -1, d["embedding_rows"])]
    for layer in range(sb.layers):
        plan += [PlannedLaunch(ATTENTION_PROJECTIONS, "qkv_gemv", layer, d["qkv_weights"]),
                 PlannedLaunch(ATTENTION, "qk_norm_rope_append", layer, d["kv_write"]),
                 PlannedLaunch(ATTENTION, "decode_attention", layer, d["kv_read"]),
                 PlannedLaunch(ATTENTION_PROJECTIONS, "o_gemv", layer, d["o_weights"]),
                 PlannedLaunch(ROUTER, "fused_router", layer, d["router_weights"])]
        for name, nbytes in zip(moe_stages, moe_stage_bytes(moe_stages, unique[layer] * d["expert_bytes"]),
                                strict=True):
            plan.append(PlannedLaunch(MOE, f"moe:{name}", layer, nbytes))
    plan += [PlannedLaunch(LM_HEAD, "lm_head_argmax", -1, d["lm_head_weights"]),
             PlannedLaunch(OTHER, "bump_lengths", -1, 0.0)]
    return plan


def block_totals(plan: Sequence[PlannedLaunch]) -> dict[str, float]:
    """The plan's bytes per block (every block of :data:`BLOCKS`, 0 where none)."""
    totals = dict.fromkeys(BLOCKS, 0.0)
    for launch in plan:
        totals[launch.block] += launch.nbytes
    return totals
