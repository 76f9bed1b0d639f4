"""Kernels of a whole decode step beyond the MoE layer (issue #59): each with its own entry point, not a variant."""

from __future__ import annotations

from kernels.decode.router import ROUTER, fused_router

__all__ = ["ROUTER", "fused_router"]
