"""warp-decode lab's library: the data contract, shapes, routing, the NumPy reference, and the kernels.

Import-light: nothing here touches a GPU until a GPU entry point is called, and the public names below are
imported on first use -- so ``import kernels.compile`` (the report tools' one need) loads NumPy, not ml_dtypes,
whose import alone takes ~1 s on two CPU cores.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kernels import _compat  # noqa: F401  (first: NumPy 2.5 vs older numba-cuda, see kernels/_compat.py)

if TYPE_CHECKING:
    from kernels.api import expert_centric, moe_decode, warp_decode
    from kernels.arrays import BF16
    from kernels.contract import check_inputs
    from kernels.formats import fp8_experts_from_checkpoint, gpt_oss_experts_from_checkpoint, quantize_weights
    from kernels.problem import Problem, make_problem, make_weights
    from kernels.routing import ROUTINGS, make_routing, route
    from kernels.shapes import DEFAULT_MODEL, PRESETS, Dims, MoEShape, get_shape

# public name -> the module that defines it
_HOMES = {
    "expert_centric": "kernels.api",
    "moe_decode": "kernels.api",
    "warp_decode": "kernels.api",
    "BF16": "kernels.arrays",
    "check_inputs": "kernels.contract",
    "fp8_experts_from_checkpoint": "kernels.formats",
    "gpt_oss_experts_from_checkpoint": "kernels.formats",
    "quantize_weights": "kernels.formats",
    "Problem": "kernels.problem",
    "make_problem": "kernels.problem",
    "make_weights": "kernels.problem",
    "ROUTINGS": "kernels.routing",
    "make_routing": "kernels.routing",
    "route": "kernels.routing",
    "DEFAULT_MODEL": "kernels.shapes",
    "Dims": "kernels.shapes",
    "PRESETS": "kernels.shapes",
    "MoEShape": "kernels.shapes",
    "get_shape": "kernels.shapes",
}

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
    "gpt_oss_experts_from_checkpoint",
    "make_problem",
    "make_routing",
    "make_weights",
    "moe_decode",
    "quantize_weights",
    "route",
    "warp_decode",
]


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then kept here)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
