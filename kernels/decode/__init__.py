"""The kernels of a whole Qwen3-MoE decode step beyond the MoE layer, and the step that composes them.

Per layer (``step.build_step``): the QKV GEMV with the residual add and RMSNorm in its prologue (``gemv``; tensor
cores from T = 9, ``gemv_mma``) -> per-head q/k RMSNorm + RoPE + the KV-cache append (``attention``) -> decode
attention split along the context, combined by each (sequence, KV head)'s last block (``attention``) -> the O GEMV with
the residual in its epilogue -> the fused router (RMSNorm prologue, logits over the grid, softmax and top-k in each
token's last block; ``router``) -> the MoE (``kernels.moe_decode``'s paths) -> the next layer. The final RMSNorm
fuses into the LM head's GEMV, whose argmax epilogue writes the next tokens. Every kernel is a ``KernelFamily`` with a
``PDL`` knob (programmatic launches that wait before reading what the kernel before them wrote) and a zero-argument
stage function for graph capture.

The order contract (its numbered items: notes/decode-step.md): each kernel's FP32 operations run in an order the NumPy
twins of ``kernels.numerics`` (``dot_chain``, ``rms_norm_chain``, ``head_norm_rope``, ``chunked_attention``,
``router_chain``, ``exp_rn``) and ``kernels.decode.moe_order`` reproduce bit for bit -- a lane's chain of 16-byte chunks
then the warp butterfly for every dot product, explicit ``__fmul_rn`` / ``__fadd_rn`` where a product of non-bf16 values
is summed, ``exp_rn`` (correctly rounded multiplies and adds only) instead of ``expf`` -- so the reference's bf16 mode
(``kernels.decode_reference``) is the step's bitwise target (the tensor-core GEMV, T >= 9, within a tolerance).
"""

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
from kernels.decode.router import ROUTER, RouterWorkspace, fused_router, make_router_workspace, router_stage

__all__ = ["ATTENTION", "GEMV", "GEMV_MMA", "ROPE", "ROUTER", "AttentionWorkspace", "GemvWorkspace", "RouterWorkspace",
           "attention_stage", "decode_attention", "dense_gemv", "fused_router", "gemv_launch",
           "make_attention_workspace", "make_gemv_workspace", "make_router_workspace", "qk_norm_rope_append",
           "qk_rope_stage", "rope_tables", "router_stage"]
