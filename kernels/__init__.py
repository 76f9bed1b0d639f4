"""warp-decode lab's library: the data contract, shapes, routing, the NumPy reference, and the kernels.

Import-light: nothing here touches a GPU until a GPU entry point is called.
"""

from kernels import _compat  # noqa: F401  (first: NumPy 2.5 vs older numba-cuda, see kernels/_compat.py)
from kernels.api import expert_centric, moe_decode, warp_decode
from kernels.contract import BF16, Dims, check_inputs
from kernels.formats import fp8_experts_from_checkpoint, quantize_weights
from kernels.problem import Problem, make_problem, make_weights
from kernels.routing import ROUTINGS, make_routing, route
from kernels.shapes import DEFAULT_MODEL, PRESETS, MoEShape, get_shape

__all__ = [
    "BF16",
    "DEFAULT_MODEL",
    "PRESETS",
    "ROUTINGS",
    "Dims",
    "MoEShape",
    "Problem",
    "check_inputs",
    "expert_centric",
    "fp8_experts_from_checkpoint",
    "get_shape",
    "make_problem",
    "make_routing",
    "make_weights",
    "moe_decode",
    "quantize_weights",
    "route",
    "warp_decode",
]
