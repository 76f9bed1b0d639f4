"""Kernels of a whole decode step beyond the MoE layer (issue #59): each with its own entry point, not a variant."""

from __future__ import annotations

from kernels.decode.router import ROUTER, RouterWorkspace, fused_router, make_router_workspace

__all__ = ["ROUTER", "RouterWorkspace", "fused_router", "make_router_workspace"]
