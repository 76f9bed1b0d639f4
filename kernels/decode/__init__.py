"""Kernels of a whole decode step beyond the MoE layer (issue #59): each with its own entry point, not a variant."""

from __future__ import annotations

from kernels.decode.attention import (
    ATTENTION,
    ROPE,
    AttentionWorkspace,
    attention_stage,
    decode_attention,
    make_attention_workspace,
    qk_norm_rope_append,
    qk_rope_stage,
    rope_tables,
)
from kernels.decode.gemv import GEMV, GemvWorkspace, dense_gemv, gemv_launch, make_gemv_workspace
from kernels.decode.gemv_mma import GEMV_MMA
from kernels.decode.router import ROUTER, RouterWorkspace, fused_router, make_router_workspace

__all__ = ["ATTENTION", "GEMV", "GEMV_MMA", "ROPE", "ROUTER", "AttentionWorkspace", "GemvWorkspace", "RouterWorkspace",
           "attention_stage", "decode_attention", "dense_gemv", "fused_router", "gemv_launch",
           "make_attention_workspace", "make_gemv_workspace", "make_router_workspace", "qk_norm_rope_append",
           "qk_rope_stage", "rope_tables"]
