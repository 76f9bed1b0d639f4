"""What the batched families share on the host: a family per weight format, the workspace, register caps.

:class:`FormatFamilies` builds one :class:`~kernels.family.KernelFamily` per weight format for a mechanism (the FMA
pair, the tensor-core pair, the per-pair pair): the mechanism's CUDA C with the format's loader
(:mod:`kernels.batched.loaders`) in front of its kernels, so that the kernels never branch on the format.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kernels.activation import CONTRACT_LAYER, ExpertLayer
from kernels.batched import lists
from kernels.batched.lists import lists_size
from kernels.compile import launch_ex
from kernels.contract import BF16, Dims
from kernels.family import KernelFamily
from kernels.formats import Quantized, WeightFormat, get_format

REGISTERS_PER_BLOCK = 65536  # sm_70 .. sm_90
DEFAULT_MAX_REGS = 128  # GB_MAX_REGS / DB_MAX_REGS where auto (-1) and no rule caps lower: spill-free at the defaults
NO_SCALES = np.uint64(0)  # the scale pointer of unscaled weights (never read)


class FormatFamilies:
    """One kernel family per weight format and expert layer for a mechanism, built on first use by ``make(fmt,
    layer)`` (the contract's layer on ``formats`` at once, so that the compile report sees them):
    ``families("fp8-block128")`` is the mechanism on fp8-block128 weights, ``families("mxfp4", layer)`` the same with
    gpt-oss's activation and biases (:class:`~kernels.activation.ExpertLayer`) compiled in."""

    def __init__(self, make: Callable[[WeightFormat, ExpertLayer], KernelFamily], formats: tuple[str, ...]) -> None:
        self._make = make
        self._families: dict[tuple[str, ExpertLayer], KernelFamily] = {}
        for name in formats:
            self(name)

    def __call__(self, fmt: WeightFormat | str, layer: ExpertLayer = CONTRACT_LAYER) -> KernelFamily:
        fmt = get_format(fmt)
        family = self._families.get((fmt.name, layer))
        if family is None:
            family = self._families[(fmt.name, layer)] = self._make(fmt, layer)
        return family

    @property
    def families(self) -> dict[str, KernelFamily]:
        """The contract layer's families by format name."""
        return {name: family for (name, layer), family in self._families.items() if layer.contract}


def family_suffix(fmt: WeightFormat, layer: ExpertLayer) -> str:
    """How a family's (and its source's) name says its format and layer: "" for bf16 and the contract's layer."""
    if fmt.name == "bf16" and layer.contract:
        return ""
    return f"[{fmt.name}{layer.suffix}]"


def sample_variants(resolve: Callable[..., dict[str, int]], defaults: dict[str, int],
                    knob_sets: tuple[dict[str, int], ...] = ({},)) -> list[dict[str, int]]:
    """What a family's offline compile report compiles besides its defaults: the knob sets ``resolve(dims, **knobs)``
    gives at qwen3-30b-a3b T = 1 and 64 and qwen3-235b-a22b T = 4 (the dispatch's regimes; ``tools.sass_hashes``
    covers every pick), as overrides of ``defaults``, skipping dims a format cannot hold."""
    from kernels.shapes import PRESETS

    seen: list[dict[str, int]] = []
    for model, t in (("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 64), ("qwen3-235b-a22b", 4)):
        shape = PRESETS[model]
        dims = Dims(t, shape.hidden, shape.intermediate, shape.experts, shape.top_k)
        for knobs in knob_sets:
            try:
                params = resolve(dims, **knobs)
            except ValueError:
                continue
            override = {key: value for key, value in params.items() if defaults.get(key) != value}
            if override not in seen:
                seen.append(override)
    return seen


def block_registers(warps: int, cap: int) -> int:
    """Registers a block of ``warps`` warps takes under a __maxnreg__ ``cap`` (allocated in units of 8)."""
    return warps * 32 * -(-cap // 8) * 8


def check_register_caps(values: dict[str, int], stages: tuple[str, ...] = ("GB", "DB")) -> None:
    """Each stage's -1 cap ("auto") not set by a rule becomes :data:`DEFAULT_MAX_REGS`; ValueError where a cap times
    the block's threads exceeds the register file (the launch would fail)."""
    for stage in stages:
        if values[f"{stage}_MAX_REGS"] == -1:
            values[f"{stage}_MAX_REGS"] = DEFAULT_MAX_REGS
        warps, cap = values[f"{stage}_WARPS"], values[f"{stage}_MAX_REGS"]
        if cap and block_registers(warps, cap) > REGISTERS_PER_BLOCK:
            raise ValueError(
                f"{stage}_WARPS {warps} x 32 threads x {stage}_MAX_REGS {cap} registers exceeds the "
                f"{REGISTERS_PER_BLOCK} registers of a block (the launch would fail): lower {stage}_WARPS or "
                f"{stage}_MAX_REGS (0 lets __launch_bounds__ fit the block)")


def experts_average(dims: Dims, pairs: float) -> bool:
    """T*K >= pairs x E: an expert averages at least ``pairs`` (token, expert) pairs (qwen3, E / K = 16: from
    T = 16 x pairs) -- the load measure the auto rules switch on."""
    return dims.tokens * dims.top_k >= pairs * dims.experts


def weight_args(w: Any, fmt: WeightFormat) -> tuple[Any, Any]:
    """A weight matrix as the kernels take it: (values, scales), the scales a null pointer for an unscaled format."""
    values = w.values if isinstance(w, Quantized) else w
    return values, (w.scales if fmt.scaled else NO_SCALES)


def global_arg(w: Any, fmt: WeightFormat) -> Any:
    """A weight matrix's float32 scale per expert as the batched kernels take it (before the biases): a null pointer
    for a format without one."""
    return w.global_scale if fmt.global_scaled else NO_SCALES


@dataclass
class Workspace:
    """The buffers a batched family needs, allocated once per dims (and knob set: the grouped down's rows)."""

    dims: Dims
    intermediate: Any  # [T, K, I] bf16 (the same buffer as strict warp decode's)
    lists: Any = None  # [lists_size(dims)] int32: routing lists written by moe_expert_lists (not the per-pair path)
    pair_out: Any = None  # [T*K, H] float32: each pair's weighted down row (the grouped down only)

    def matches(self, dims: Dims) -> bool:
        return self.dims == dims


def bias_args(b13: Any, b2: Any) -> tuple[Any, Any]:
    """The experts' biases as the kernels take them (their last arguments): null pointers for a layer without."""
    return (NO_SCALES if b13 is None else b13), (NO_SCALES if b2 is None else b2)


def list_stages(compiled: Any, fmt: WeightFormat, kernels: tuple[Any, Any, Any], gate_up_blocks: int,
                down_blocks: int, down_shared: int, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any,
                out: Any, b13: Any = None, b2: Any = None) -> list[tuple[str, Any]]:
    """The three launches the FMA pair and the tensor-core pair's balanced down share -- the lists, a gate_up from the
    lists into the intermediate, a down from the intermediate into ``out`` (the kernels take the same arguments, the
    last two the matrix's scale per expert, :func:`global_arg`, and the biases, :func:`bias_args`) -- as named
    zero-argument callables on ``compiled``'s workspace."""
    params, d, ws = compiled.params, compiled.dims, compiled.workspace
    lists_k, gate_up_k, down_k = kernels
    bias13, bias2 = bias_args(b13, b2)
    g13, g2 = (global_arg(w13, fmt), bias13), (global_arg(w2, fmt), bias2)
    w13, s13 = weight_args(w13, fmt)
    w2, s2 = weight_args(w2, fmt)
    i32, n_slots, programmatic = np.int32, lists.slots(d), bool(params["PDL"])
    lists.opt_in_shared(down_k, down_shared)

    def gate_up() -> None:
        launch_ex(gate_up_k, (gate_up_blocks,), (params["GB_WARPS"] * 32,),
                  (x, w13, s13, ws.lists, ws.intermediate, i32(d.hidden), i32(d.intermediate), i32(d.experts),
                   i32(d.top_k), i32(n_slots), i32(d.tokens * d.top_k), *g13), programmatic=programmatic)

    def down() -> None:
        launch_ex(down_k, (down_blocks,), (params["DB_WARPS"] * 32,),
                  (ws.intermediate, w2, s2, topk_ids, topk_weights, ws.lists, out,
                   i32(1 if out.dtype == np.float32 else 0), i32(d.tokens), i32(d.hidden), i32(d.intermediate),
                   i32(d.experts), i32(d.top_k), i32(n_slots), *g2), shared_mem=down_shared,
                  programmatic=programmatic)

    return [("expert_lists", lists.lists_stage(lists_k, d, params, topk_ids, ws.lists)), ("gate_up", gate_up),
            ("down", down)]


def check_dims(dims: Any) -> None:
    """TypeError / ValueError unless ``dims`` is a Dims of ints >= 1."""
    if not isinstance(dims, Dims):
        raise TypeError(f"dims must be a kernels.contract.Dims, got {type(dims).__name__}")
    for name in ("tokens", "hidden", "intermediate", "experts", "top_k"):
        value = getattr(dims, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"dims.{name} must be an int >= 1, got {value!r}")


def allocate(dims: Dims, lists: bool, pair_out: bool) -> Workspace:
    """The intermediate, and the lists buffer and the per-pair rows where asked (CuPy, current device)."""
    import cupy

    return Workspace(
        dims=dims,
        intermediate=cupy.empty((dims.tokens, dims.top_k, dims.intermediate), dtype=BF16),
        lists=cupy.zeros(lists_size(dims), dtype=cupy.int32) if lists else None,
        pair_out=cupy.empty((dims.tokens * dims.top_k, dims.hidden), dtype=np.float32) if pair_out else None,
    )
