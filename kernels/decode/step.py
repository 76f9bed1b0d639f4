"""The whole Qwen3-MoE decode step on the GPU: one graph-capturable sequence of launches, nothing allocated, no host
sync, every launch of a PDL family programmatic.

    model = kernels.decode_reference.make_model("qwen3-30b-a3b", layers=4)     # 4 distinct layer copies ...
    dm = DeviceModel.from_model(model, "bf16", cycle_to=48)                    # ... cycled through 48 step layers
    ds = DeviceState.random(dm, lengths=[2048], capacity=2112)                 # or DeviceState.from_state(state)
    step = build_step(dm, ds, T=1, moe="warp-decode")
    step.set_tokens([17]); step.run(); step.read_back().next_tokens

Per layer (token t of the step is sequence slot t; ``lengths`` [T] int32 on the device holds each slot's positions
before the step; kernels.decode_reference states the model):

1. QKV GEMV, its prologue the residual add (h := bf16(h + moe_out), the previous layer's MoE output; layer 0: the
   embedded tokens alone) and the input RMSNorm (``dense_gemv(norm=, add=, residual_out=)``);
2. per-head q/k RMSNorm + RoPE + KV-cache append (``qk_norm_rope_append``), decode attention over each slot's
   lengths[t] + 1 positions (``decode_attention``);
3. O GEMV, the residual added in its epilogue (``residual_in=``, out aliasing it);
4. the fused router with the post-attention RMSNorm in its prologue, writing ``moe_in`` and the routing;
5. the MoE on ``moe_in`` into ``moe_out``: ``moe="warp-decode"`` (the path ``kernels.moe_decode`` picks under its
   ``warp_decode`` policy, ``kernels.dispatch.build``), ``"strict"`` (strict warp decode: the order the reference's
   bf16 mode reproduces), ``"expert-centric"`` (bf16: ``cupy:expert-centric``; fp8: its W8A8 form), or a callable
   ``hook(dims, weight_format) -> kernels.variants.Launch`` (``tools.peers``' Triton peer plugs in so).

Then the LM head GEMV: the last residual add and the final RMSNorm in its prologue, argmax in its epilogue into
``tokens`` -- the next step's embedding input, on the device -- and a one-thread kernel adds 1 to ``lengths``.
The residual stream ping-pongs between two [T, H] buffers (a GEMV that writes the summed residual must not write the
buffer its other blocks still read). The MoE runs through its variant's stages (no input checks: ``moe_decode``'s
strict path range-checks the ids on the host, a sync, outside a graph capture).

fp8-block128 quantizes the q/k/v/o projections and the experts (e4m3 values, a float32 scale per 128 x 128 block);
the embedding, norms, router and LM head stay bf16 (:mod:`kernels.decode.accounting`).

The calls into the other decode kernels (``kernels.decode.gemv``, ``kernels.decode.attention``, the router's norm
prologue) each sit in one function below (``_gemv``, ``_qk_rope``, ``_attention``, ``_router``, the workspaces'
``_make_*``), coded to the contract of issue #59's kernels.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kernels.arrays import BF16, check_int
from kernels.compile import CudaSource, launch_ex
from kernels.contract import Dims
from kernels.decode.accounting import (
    ATTENTION,
    ATTENTION_PROJECTIONS,
    BLOCKS,
    LM_HEAD,
    MOE,
    OTHER,
    ROUTER,
    check_step_format,
)
from kernels.decode_reference import DecodeState, Model, SequenceCache
from kernels.device_helpers import PDL_HELPERS, WARP_HELPERS
from kernels.family import KernelFamily
from kernels.formats import Quantized
from kernels.numerics import rms_norm_chain

MOE_PATHS = ("warp-decode", "strict", "expert-centric")
# moe -> weight format -> the registered variant whose stages run it ("warp-decode": kernels.dispatch.build)
MOE_VARIANTS: dict[str, dict[str, str]] = {
    "strict": {"bf16": "cupy:warp-decode", "fp8-block128": "cupy:warp-decode-fp8"},
    "expert-centric": {"bf16": "cupy:expert-centric", "fp8-block128": "cupy:expert-centric-w8a8"},
}
MOE_POLICY = "warp_decode"  # moe="warp-decode": kernels.moe_decode's choice among the warp-decode paths

# -- the step's own kernels: the embedding gather and the lengths bump ------------------------------------------------
CODE = r"""
// ==== the decode step's own kernels (kernels/decode/step.py) ====
// Knobs: THREADS threads per block of embed_tokens; PDL 1: launched with programmatic serialization (wait first).
static_assert(PDL == 0 || PDL == 1, "PDL must be 0 or 1");

// embed_tokens: grid (T); block t copies the embedding row of tokens[t] into h[t], thread i taking 16-byte chunks
// i, i + THREADS, ... A token outside [0, vocab) gives a NaN row (never an out-of-bounds read). tokens were written
// by the previous step's LM head and h is read by it: everything after the PDL wait.
extern "C" __global__ void __launch_bounds__(THREADS) embed_tokens(
    const int* __restrict__ tokens,          // [T]
    const bf16_t* __restrict__ embed,        // [V, H]
    bf16_t* __restrict__ h,                  // [T, H]
    int hidden, int vocab)
{
    pdl_wait();
    const int t = blockIdx.x;
    const int token = ld_dep(tokens + t);
    const bool ok = token >= 0 && token < vocab;
    const int chunks = hidden / 8;
    const uint4* src = reinterpret_cast<const uint4*>(embed + (size_t)(ok ? token : 0) * hidden);
    uint4* dst = reinterpret_cast<uint4*>(h + (size_t)t * hidden);
    const uint4 nan_row = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
    for (int c = threadIdx.x; c < chunks; c += THREADS) dst[c] = ok ? __ldg(src + c) : nan_row;
    pdl_release();
}

// bump_lengths: one thread adds 1 to each slot's length, after the step's last kernel (which waited for every
// kernel before it) finished: the append and attention read the old lengths.
extern "C" __global__ void bump_lengths(int* __restrict__ lengths, int count)
{
    pdl_wait();
    if (blockIdx.x == 0 && threadIdx.x == 0)
        for (int i = 0; i < count; ++i) lengths[i] += 1;
}
"""
EMBED = "embed_tokens"
BUMP = "bump_lengths"
KNOBS = {"THREADS": 128, "PDL": 1}
SOURCE = CudaSource(name="decode_step", code=WARP_HELPERS + PDL_HELPERS + CODE, kernels=(EMBED, BUMP),
                    defaults=dict(KNOBS), variants=[{"THREADS": 256, "PDL": 0}],
                    description="the decode step's embedding gather and lengths bump (kernels/decode/step.py)")
STEP_KERNELS = KernelFamily(name="decode-step", source=SOURCE, limits={"THREADS": (32, 1024), "PDL": (0, 1)},
                            device_needs={"PDL": 90})


# -- the calls into the other decode kernels: one place each ----------------------------------------------------
def _module(name: str) -> Any:
    return importlib.import_module(f"kernels.decode.{name}")


def _gemv(x: Any, w: Any, out: Any, pdl: int, **kw: Any) -> Callable[[], None]:
    """``kernels.decode.gemv.gemv_launch``: checked and compiled now, the callable only launches."""
    return _module("gemv").gemv_launch(x, w, out, PDL=pdl, **kw)


def _make_gemv_workspace(tokens: int) -> Any:
    """The LM head's workspace (its argmax over the vocabulary's blocks)."""
    return _module("gemv").make_gemv_workspace(tokens)


def _qk_rope(qkv: Any, q_norm: Any, k_norm: Any, cos: Any, sin: Any, lengths: Any, q_out: Any, k_cache: Any,
             v_cache: Any, heads: int, kv_heads: int, eps: float, pdl: int, **knobs: int) -> Callable[[], None]:
    return _module("attention").qk_rope_stage(qkv, q_norm, k_norm, cos, sin, lengths, q_out, k_cache, v_cache,
                                              heads=heads, kv_heads=kv_heads, eps=eps, PDL=pdl, **knobs)


def _attention(q: Any, k_cache: Any, v_cache: Any, lengths: Any, out: Any, workspace: Any,
               pdl: int, **knobs: int) -> Callable[[], None]:
    return _module("attention").attention_stage(q, k_cache, v_cache, lengths, out, workspace, PDL=pdl, **knobs)


def _make_attention_workspace(tokens: int, heads: int, kv_heads: int, head_dim: int, capacity: int,
                              pdl: int, **knobs: int) -> Any:
    return _module("attention").make_attention_workspace(tokens, heads, kv_heads, head_dim, capacity, PDL=pdl,
                                                         **knobs)


def rope_tables(positions: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [positions, head_dim / 2] (host): ``kernels.decode.attention.rope_tables``."""
    return _module("attention").rope_tables(positions, head_dim, theta)


def _router(h: Any, w_router: Any, top_k: int, norm_topk_prob: bool, topk_ids: Any, topk_weights: Any,
            workspace: Any, norm: Any, moe_in: Any, eps: float, pdl: int, **knobs: int) -> Callable[[], None]:
    return _module("router").router_stage(h, w_router, top_k, norm_topk_prob, topk_ids, topk_weights, workspace,
                                          norm=norm, moe_in=moe_in, eps=eps, PDL=pdl, **knobs)


def _make_router_workspace(tokens: int, experts: int) -> Any:
    return _module("router").make_router_workspace(tokens, experts)


# the step's kernels whose knobs build_step's kernel_knobs sets, each by its role: the three GEMVs (knobs of
# kernels.decode.gemv and gemv_mma, and MMA: which of the two), q/k norm + RoPE + append, attention, the router
KERNEL_ROLES = ("qkv", "o", "lm_head", "rope", "attention", "router")


def kernel_knob_limits(role: str) -> dict[str, tuple[int, int]]:
    """The knobs ``build_step(kernel_knobs={role: ...})`` takes for ``role`` and the widest range each may hold (the
    kernel family checks the rest when the step is built); PDL is the whole step's (``step_knobs``)."""
    if role not in KERNEL_ROLES:
        raise ValueError(f"unknown kernel {role!r}; the step's kernels with knobs: {', '.join(KERNEL_ROLES)}")
    if role in ("qkv", "o", "lm_head"):
        gemv, mma = _module("gemv").GEMV, _module("gemv_mma").GEMV_MMA
        limits = {"MMA": (-1, 1)}
        for name in {**gemv.limits, **mma.limits}:
            ranges = [f.limits[name] for f in (gemv, mma) if name in f.limits]
            limits[name] = (min(r[0] for r in ranges), max(r[1] for r in ranges))
    else:
        family = {"rope": ("attention", "ROPE"), "attention": ("attention", "ATTENTION"),
                  "router": ("router", "ROUTER")}[role]
        limits = dict(getattr(_module(family[0]), family[1]).limits)
    limits.pop("PDL", None)
    return limits


def _kernel_knobs(kernel_knobs: Mapping[str, Mapping[str, int]] | None) -> dict[str, dict[str, int]]:
    """``kernel_knobs`` checked: known roles, known knob names (values: the families' checks), no PDL."""
    if kernel_knobs is None:
        kernel_knobs = {}
    if not isinstance(kernel_knobs, Mapping):
        raise TypeError(f"kernel_knobs must be a mapping of kernel role -> knobs, got {type(kernel_knobs).__name__}")
    out: dict[str, dict[str, int]] = {}
    for role, knobs in kernel_knobs.items():
        try:
            limits = kernel_knob_limits(role)
        except ValueError as exc:
            raise ValueError(f"kernel_knobs: {exc}") from None
        if not isinstance(knobs, Mapping):
            raise TypeError(f"kernel_knobs[{role!r}] must be a mapping of knob -> int, got {type(knobs).__name__}")
        unknown = sorted(set(knobs) - set(limits))
        if unknown:
            raise ValueError(f"kernel_knobs[{role!r}]: unknown knob(s) {unknown}; known: {', '.join(sorted(limits))}"
                             + (" (PDL is the whole step's: step_knobs)" if "PDL" in unknown else ""))
        out[role] = dict(knobs)
    return {role: out.get(role, {}) for role in KERNEL_ROLES}


# -- the model and the state on the device -------------------------------------------------------------------------
def _upload(arr: np.ndarray) -> Any:
    import cupy

    return cupy.asarray(np.ascontiguousarray(arr))


def _upload_values(values: np.ndarray) -> Any:
    """Quantized values on the device: CuPy has no float8 dtype, the kernels read the e4m3fn bit patterns as uint8."""
    values = np.asarray(values)
    if values.dtype.itemsize != 1:
        raise TypeError(f"fp8-block128 values must be float8_e4m3fn or their uint8 bits, got {values.dtype}")
    return _upload(values.view(np.uint8))


def _dense(w: Any, weight_format: str) -> Any:
    """A dense [N, K] matrix on the device: bf16, or fp8-block128 as Quantized(uint8 values [N, K], float32 scales
    [ceil(N/128), ceil(K/128)]) -- quantized here from bf16, or uploaded as the reference model holds it."""
    if isinstance(w, Quantized):
        return dataclasses.replace(w, values=_upload_values(w.values), scales=_upload(w.scales))
    device = _upload(w)
    if weight_format == "bf16":
        return device
    from kernels.quantize_cuda import quantize_matrix

    values, scales = quantize_matrix(device[None], "w2")  # one [N, K] "expert", blocked 128 x 128
    return Quantized(values[0], scales[0])


def _experts(w13: Any, w2: Any, weight_format: str) -> tuple[Any, Any]:
    """The experts on the device in ``weight_format``: uploaded as the reference model holds them (bf16 or
    quantized on the host), or quantized on the device from bf16."""
    if isinstance(w13, Quantized):
        return tuple(dataclasses.replace(w, values=_upload_values(w.values),
                                         scales=None if w.scales is None else _upload(w.scales)) for w in (w13, w2))
    w13, w2 = _upload(w13), _upload(w2)
    if weight_format != "bf16":
        from kernels import quantize_weights

        w13, w2 = quantize_weights(w13, w2, weight_format)
    return w13, w2


@dataclass
class DeviceLayer:
    """One decoder layer's weights on the device (:class:`kernels.decode_reference.LayerWeights`' names)."""

    input_norm: Any
    wqkv: Any
    q_norm: Any
    k_norm: Any
    wo: Any
    post_norm: Any
    router: Any
    w13: Any
    w2: Any


@dataclass
class DeviceModel:
    """A reference model's weights uploaded once. ``layers[i]`` is the i-th distinct layer; the step's layer l uses
    ``layers[order[l]]`` (``cycle_to``: distinct copies cycled through more step layers, for a model that does not
    fit: its bytes per step are the full model's, its distinct weights far past the L2)."""

    config: Any
    weight_format: str
    embed: Any
    final_norm: Any
    lm_head: Any
    layers: list[DeviceLayer]
    order: tuple[int, ...]

    @property
    def step_layers(self) -> int:
        return len(self.order)

    @classmethod
    def from_model(cls, model: Model, weight_format: str = "bf16", cycle_to: int | None = None) -> DeviceModel:
        """Upload ``model`` (``kernels.decode_reference.make_model``); ``cycle_to``: the step's layer count when
        larger than the model's (its layers repeated in order: layer l is model layer l % n)."""
        weight_format = check_step_format(weight_format)
        order = cycle_order(model, cycle_to)
        if model.weight_format != "bf16" and model.weight_format != weight_format:
            raise ValueError(f"model holds {model.weight_format!r} weights: upload them as such, not as "
                             f"{weight_format!r}")

        distinct: list[DeviceLayer] = []
        index: dict[int, int] = {}
        layer_order = []
        for layer in model.layers:
            if id(layer) not in index:  # a model whose layers repeat (cycle_model) is uploaded once per copy
                w13, w2 = _experts(layer.w13, layer.w2, weight_format)
                index[id(layer)] = len(distinct)
                distinct.append(DeviceLayer(_upload(layer.input_norm), _dense(layer.wqkv, weight_format),
                                            _upload(layer.q_norm), _upload(layer.k_norm),
                                            _dense(layer.wo, weight_format), _upload(layer.post_norm),
                                            _upload(layer.router), w13, w2))
            layer_order.append(index[id(layer)])
        return cls(model.config, weight_format, _upload(model.embed), _upload(model.final_norm),
                   _upload(model.lm_head), distinct, tuple(layer_order[i] for i in order))


def cycle_order(model: Model, cycle_to: int | None) -> tuple[int, ...]:
    """The model layer each step layer runs: 0..n-1, or with ``cycle_to`` >= n, l % n for l < cycle_to."""
    n = len(model.layers)
    if cycle_to is None:
        return tuple(range(n))
    cycle_to = check_int("cycle_to", cycle_to, n)
    return tuple(i % n for i in range(cycle_to))


def cycle_model(model: Model, cycle_to: int) -> Model:
    """The reference model a cycled :class:`DeviceModel` computes: ``model``'s layers repeated in order to
    ``cycle_to`` layers (the same arrays, nothing copied), so the reference steps what the device steps."""
    return Model(model.config, model.embed, tuple(model.layers[i] for i in cycle_order(model, cycle_to)),
                 model.final_norm, model.lm_head)


def cache_to_device_layout(state: DecodeState, layers: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A bf16 reference state's caches as the step's per-layer [S, kv_heads, capacity, D] K and V (host arrays)."""
    if state.mode != "bf16":
        raise ValueError(f"a device state holds bf16 caches: pass a bf16-mode DecodeState (to_mode('bf16')), got "
                         f"mode {state.mode!r}")
    capacities = {s.capacity for s in state.sequences}
    if len(capacities) != 1:
        raise ValueError(f"the device cache needs one capacity for every sequence, got {sorted(capacities)}")
    if state.sequences[0].keys.shape[0] != layers:
        raise ValueError(f"the state holds {state.sequences[0].keys.shape[0]} layers' caches, the step has {layers}")
    keys = [np.ascontiguousarray(np.stack([s.keys[layer].transpose(1, 0, 2) for s in state.sequences]))
            for layer in range(layers)]
    values = [np.ascontiguousarray(np.stack([s.values[layer].transpose(1, 0, 2) for s in state.sequences]))
              for layer in range(layers)]
    return keys, values


def cache_from_device_layout(keys: Sequence[np.ndarray], values: Sequence[np.ndarray],
                             lengths: Sequence[int]) -> DecodeState:
    """The inverse of :func:`cache_to_device_layout`: a bf16 DecodeState of the per-layer caches and ``lengths``."""
    sequences = []
    for slot, length in enumerate(lengths):
        k = np.stack([layer[slot].transpose(1, 0, 2) for layer in keys])
        v = np.stack([layer[slot].transpose(1, 0, 2) for layer in values])
        sequences.append(SequenceCache(np.ascontiguousarray(k), np.ascontiguousarray(v), int(length)))
    return DecodeState("bf16", sequences)


@dataclass
class DeviceState:
    """T sequence slots' KV caches on the device: per step layer ``k_cache[l]``, ``v_cache[l]`` [S, kv_heads,
    capacity, D] bf16, and ``lengths`` [S] int32 (positions held before the next step)."""

    k_cache: list[Any]
    v_cache: list[Any]
    lengths: Any

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.k_cache[0].shape[2])

    @classmethod
    def from_state(cls, state: DecodeState, layers: int | None = None) -> DeviceState:
        """Upload a bf16 reference state (``new_state`` / ``prefill`` in mode "bf16", or ``to_mode("bf16")``)."""
        layers = state.sequences[0].keys.shape[0] if layers is None else layers
        keys, values = cache_to_device_layout(state, layers)
        return cls([_upload(k) for k in keys], [_upload(v) for v in values],
                   _upload(state.lengths.astype(np.int32)))

    @classmethod
    def random(cls, model: DeviceModel, lengths: Sequence[int], capacity: int | None = None,
               seed: int = 0) -> DeviceState:
        """Caches of random bf16 N(0, 1) contents made on the device (long contexts at real width without a host
        copy): ``lengths[i]`` positions held, ``capacity`` default longest + 64."""
        import cupy

        lengths = [check_int(f"lengths[{i}]", n, 0) for i, n in enumerate(lengths)]
        capacity = max(lengths) + 64 if capacity is None else check_int("capacity", capacity, max(lengths) + 1)
        shape = model.config
        full = (len(lengths), shape.num_key_value_heads, capacity, shape.head_dim)
        rng = cupy.random.default_rng(seed)

        def bf16_normal() -> Any:
            bits = rng.standard_normal(full, dtype=cupy.float32).view(cupy.uint32)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # to nearest even (finite values)
            return rounded.astype(cupy.uint16).view(BF16)

        k = [bf16_normal() for _ in range(model.step_layers)]
        v = [bf16_normal() for _ in range(model.step_layers)]
        return cls(k, v, cupy.asarray(np.array(lengths, np.int32)))

    def to_state(self) -> DecodeState:
        """The caches and lengths read back as a bf16 reference DecodeState (a sync; for checks)."""
        return cache_from_device_layout([k.get() for k in self.k_cache], [v.get() for v in self.v_cache],
                                        self.lengths.get().tolist())

    def copy(self) -> DeviceState:
        return DeviceState([k.copy() for k in self.k_cache], [v.copy() for v in self.v_cache], self.lengths.copy())


# -- the step --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepLaunch:
    """One launch of the step: its block (:data:`kernels.decode.accounting.BLOCKS`), kernel name, layer (-1 outside
    the layers) and the zero-argument callable."""

    block: str
    kernel: str
    layer: int
    fn: Callable[[], None]


@dataclass
class StepOutput:
    """What :meth:`Step.read_back` gives: ``next_tokens`` [T] int64, and when asked ``hidden`` [T, H] bf16 (the
    final RMSNorm's output, the LM head's input: from the device's residual in the kernels' order), ``logits``
    [T, V] float32, ``topk_ids`` [layers, T, K] int32."""

    next_tokens: np.ndarray
    hidden: np.ndarray | None = None
    logits: np.ndarray | None = None
    topk_ids: np.ndarray | None = None


@dataclass
class Step:
    """One step, built once (:func:`build_step`): :meth:`run` launches it (graph-capturable), :meth:`blocks` its
    launches grouped by block, :meth:`read_back` its outputs. ``launches`` in order; ``buffers`` what it allocated."""

    device_model: DeviceModel
    device_state: DeviceState
    tokens_count: int
    moe: str
    launches: list[StepLaunch]
    buffers: dict[str, Any] = field(repr=False)

    @property
    def tokens(self) -> Any:
        """[T] int32 on the device: the step's input tokens, then (LM head's argmax) the next step's."""
        return self.buffers["tokens"]

    def set_tokens(self, tokens: Sequence[int]) -> None:
        """Copy the step's input tokens to the device (outside any graph)."""
        tokens = np.asarray(tokens)
        vocab = self.device_model.config.vocab_size
        if tokens.shape != (self.tokens_count,) or tokens.dtype.kind not in "iu":
            raise ValueError(f"tokens must be {self.tokens_count} token ids, got {tokens!r}")
        if tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(f"tokens must lie in [0, {vocab}), got [{tokens.min()}, {tokens.max()}]")
        self.tokens.set(tokens.astype(np.int32))

    def run(self) -> None:
        """Every launch of the step, in order: no allocation, no host sync (capture it in a CUDA graph)."""
        for launch in self.launches:
            launch.fn()

    def kernels_per_layer(self) -> int:
        return sum(1 for launch in self.launches if launch.layer == 0)

    def blocks(self) -> list[tuple[str, Callable[[], None]]]:
        """``[(block, callable)]`` for each block of :data:`BLOCKS` that has launches: the callable runs that block's
        launches of the whole step (every layer) in order, as the step runs them."""
        grouped: dict[str, list[Callable[[], None]]] = {}
        for launch in self.launches:
            grouped.setdefault(launch.block, []).append(launch.fn)

        def chain(fns: list[Callable[[], None]]) -> Callable[[], None]:
            def run() -> None:
                for fn in fns:
                    fn()
            return run

        return [(block, chain(grouped[block])) for block in BLOCKS if block in grouped]

    def read_back(self, hidden: bool = False, logits: bool = False, routing: bool = False) -> StepOutput:
        """The next tokens [T] (a sync), and on request the hidden state, the logits (``build_step(logits=True)``)
        and every layer's routing."""
        out = StepOutput(self.tokens.get().astype(np.int64))
        if hidden:
            residual = self.buffers["final_residual"].get()
            final_norm = self.device_model.final_norm.get()
            out.hidden = rms_norm_chain(residual, final_norm, self.device_model.config.rms_norm_eps)
        if logits:
            if self.buffers.get("logits") is None:
                raise ValueError("this step keeps no logits: build it with build_step(..., logits=True)")
            out.logits = self.buffers["logits"].get()
        if routing:
            out.topk_ids = self.buffers["topk_ids"].get()
        return out


def moe_variant(moe: str, weight_format: str) -> str:
    """The registered variant that runs ``moe`` (:data:`MOE_PATHS` but "warp-decode") on ``weight_format``."""
    if moe not in MOE_VARIANTS:
        raise ValueError(f"moe must be one of {MOE_PATHS} or a callable hook(dims, weight_format) -> Launch, got "
                         f"{moe!r}")
    return MOE_VARIANTS[moe][check_step_format(weight_format)]


def check_moe(moe: object) -> str:
    """The MoE's label: the path name, or the hook's ``__name__``; ValueError for anything else."""
    if callable(moe):
        return str(getattr(moe, "name", None) or getattr(moe, "__name__", "hook"))
    if moe not in MOE_PATHS:
        raise ValueError(f"moe must be one of {MOE_PATHS} or a callable hook(dims, weight_format) -> Launch, got "
                         f"{moe!r}")
    return str(moe)


def make_moe_launch(moe: str | Callable[..., Any], dims: Dims, weight_format: str) -> Any:
    """The MoE's :class:`kernels.variants.Launch` for ``dims`` (compiled, workspace allocated once)."""
    check_moe(moe)
    if callable(moe):
        return moe(dims, weight_format)
    if moe == "warp-decode":
        from kernels.dispatch import build

        return build(dims, MOE_POLICY, weight_format)
    from kernels.variants import get_variant, load_builtin

    load_builtin()
    return get_variant(moe_variant(moe, weight_format)).make(dims)


def _moe_stages(launch: Any, x: Any, w13: Any, w2: Any, ids: Any, weights: Any, out: Any) -> list[tuple[str, Any]]:
    if getattr(launch, "stages", None) is None:
        return [("moe", lambda: launch.run(x, w13, w2, ids, weights, out))]
    return list(launch.stages(x, w13, w2, ids, weights, out))


def build_step(device_model: DeviceModel, device_state: DeviceState, T: int,  # noqa: N803 - the lab's T
               moe: str | Callable[..., Any] = "warp-decode", logits: bool = False,
               step_knobs: dict[str, int] | None = None,
               kernel_knobs: Mapping[str, Mapping[str, int]] | None = None) -> Step:
    """The step of ``T`` tokens (slot t of ``device_state`` takes token t) on ``device_model``: buffers, workspaces and
    kernels made once; returns the :class:`Step`. ``logits``: also write the LM head's fp32 logits (a [T, V] store
    the timed step leaves out). ``step_knobs``: the embedding / lengths kernels' knobs (THREADS, PDL), PDL for every
    kernel. ``kernel_knobs``: knobs of the other kernels by role (:data:`KERNEL_ROLES`, :func:`kernel_knob_limits`),
    e.g. ``{"attention": {"SPLIT": 32}}``; unset knobs are the families' defaults and rules."""
    import cupy

    if not isinstance(device_model, DeviceModel):
        raise TypeError(f"device_model must be a DeviceModel (DeviceModel.from_model), got "
                        f"{type(device_model).__name__}")
    if not isinstance(device_state, DeviceState):
        raise TypeError(f"device_state must be a DeviceState, got {type(device_state).__name__}")
    T = check_int("T", T, 1)  # noqa: N806
    label = check_moe(moe)
    shape = device_model.config
    if device_state.batch != T:
        raise ValueError(f"device_state holds {device_state.batch} sequence slots, the step takes T = {T} tokens")
    if len(device_state.k_cache) != device_model.step_layers:
        raise ValueError(f"device_state holds {len(device_state.k_cache)} layers' caches, the model steps "
                         f"{device_model.step_layers} layers")
    H, V, E, K = shape.hidden, shape.vocab_size, shape.experts, shape.top_k  # noqa: N806
    heads, kv_heads, D = shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim  # noqa: N806
    eps, L = float(shape.rms_norm_eps), device_model.step_layers  # noqa: N806
    fmt = device_model.weight_format
    knobs = _kernel_knobs(kernel_knobs)
    params = STEP_KERNELS.for_device(STEP_KERNELS.resolve(None, **(step_knobs or {})))
    pdl = params["PDL"]  # every kernel of the step: programmatic launches waiting before their dependent reads

    bf16 = dict(dtype=BF16)
    buffers: dict[str, Any] = {
        "tokens": cupy.zeros((T,), dtype=np.int32),
        "residual": [cupy.empty((T, H), **bf16), cupy.empty((T, H), **bf16)],
        "qkv": cupy.empty((T, (heads + 2 * kv_heads) * D), **bf16),
        "q": cupy.empty((T, heads, D), **bf16),
        "attention_out": cupy.empty((T, heads * D), **bf16),
        "moe_in": cupy.empty((T, H), **bf16),
        "moe_out": cupy.empty((T, H), **bf16),
        "topk_ids": cupy.zeros((L, T, K), dtype=np.int32),
        "topk_weights": cupy.zeros((L, T, K), dtype=np.float32),
        "logits": cupy.empty((T, V), dtype=np.float32) if logits else None,
    }
    cos, sin = rope_tables(device_state.capacity, D, shape.rope_theta)
    buffers["cos"], buffers["sin"] = _upload(np.asarray(cos, np.float32)), _upload(np.asarray(sin, np.float32))
    buffers["router_workspace"] = _make_router_workspace(T, E)
    buffers["attention_workspace"] = _make_attention_workspace(T, heads, kv_heads, D, device_state.capacity, pdl,
                                                               **knobs["attention"])
    buffers["lm_head_workspace"] = _make_gemv_workspace(T)
    dims = Dims(T, H, shape.intermediate, E, K)
    moe_launch = make_moe_launch(moe, dims, fmt)
    buffers["moe_launch"] = moe_launch

    kernels = STEP_KERNELS.kernels_for(params)
    programmatic, threads = bool(params["PDL"]), params["THREADS"]
    lengths = device_state.lengths
    residual = buffers["residual"]
    i32 = np.int32

    launches = [StepLaunch(OTHER, "embed", -1, lambda: launch_ex(
        kernels[EMBED], (T,), (threads,), (buffers["tokens"], device_model.embed, residual[0], i32(H), i32(V)),
        programmatic=programmatic))]
    current = 0  # which residual buffer holds h
    for layer in range(L):
        w = device_model.layers[device_model.order[layer]]
        if layer == 0:
            qkv = _gemv(residual[0], w.wqkv, buffers["qkv"], pdl, norm=w.input_norm, eps=eps, **knobs["qkv"])
        else:  # h := bf16(h + the previous layer's MoE output), into the other buffer, then the norm
            qkv = _gemv(residual[current], w.wqkv, buffers["qkv"], pdl, norm=w.input_norm, eps=eps,
                        add=buffers["moe_out"], residual_out=residual[1 - current], **knobs["qkv"])
            current = 1 - current
        h = residual[current]
        ids, weights = buffers["topk_ids"][layer], buffers["topk_weights"][layer]
        launches += [
            StepLaunch(ATTENTION_PROJECTIONS, "qkv_gemv", layer, qkv),
            StepLaunch(ATTENTION, "qk_norm_rope_append", layer, _qk_rope(
                buffers["qkv"], w.q_norm, w.k_norm, buffers["cos"], buffers["sin"], lengths, buffers["q"],
                device_state.k_cache[layer], device_state.v_cache[layer], heads, kv_heads, eps, pdl, **knobs["rope"])),
            StepLaunch(ATTENTION, "decode_attention", layer, _attention(
                buffers["q"], device_state.k_cache[layer], device_state.v_cache[layer], lengths,
                buffers["attention_out"], buffers["attention_workspace"], pdl, **knobs["attention"])),
            StepLaunch(ATTENTION_PROJECTIONS, "o_gemv", layer, _gemv(
                buffers["attention_out"], w.wo, h, pdl, residual_in=h, **knobs["o"])),
            StepLaunch(ROUTER, "fused_router", layer, _router(
                h, w.router, K, shape.norm_topk_prob, ids, weights, buffers["router_workspace"], w.post_norm,
                buffers["moe_in"], eps, pdl, **knobs["router"])),
        ]
        for name, fn in _moe_stages(moe_launch, buffers["moe_in"], w.w13, w.w2, ids, weights, buffers["moe_out"]):
            launches.append(StepLaunch(MOE, f"moe:{name}", layer, fn))
    buffers["final_residual"] = residual[1 - current]
    launches += [
        StepLaunch(LM_HEAD, "lm_head_argmax", -1, _gemv(
            residual[current], device_model.lm_head, None, pdl, norm=device_model.final_norm, eps=eps,
            add=buffers["moe_out"], residual_out=residual[1 - current], argmax=buffers["tokens"],
            logits=buffers["logits"], workspace=buffers["lm_head_workspace"], **knobs["lm_head"])),
        StepLaunch(OTHER, "bump_lengths", -1, lambda: launch_ex(
            kernels[BUMP], (1,), (32,), (lengths, i32(T)), programmatic=programmatic)),
    ]
    return Step(device_model, device_state, T, label, launches, buffers)


def moe_stage_names(step: Step) -> list[str]:
    """The MoE's launch names of one layer (what the read floor mirrors)."""
    return [launch.kernel.removeprefix("moe:") for launch in step.launches if launch.layer == 0
            and launch.block == MOE]


__all__ = ["BLOCKS", "KERNEL_ROLES", "MOE_PATHS", "DeviceLayer", "DeviceModel", "DeviceState", "Step", "StepLaunch",
           "StepOutput", "build_step", "cache_from_device_layout", "cache_to_device_layout", "cycle_model",
           "cycle_order", "kernel_knob_limits", "make_moe_launch", "moe_variant"]
