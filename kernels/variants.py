"""The registry every measured implementation joins: the bench, the sweep and the tests read it.

A :class:`Variant` is a named way to compute one MoE decode layer. ``build(dims, **params)`` does all
allocation and compilation up front and returns a :class:`Launch`::

    launch(x, w13, w2, topk_ids, topk_weights, out) -> None

which writes ``out`` [T, H], allocates nothing, never synchronises with the host, and is therefore safe
to capture in a CUDA graph (CuPy variants) -- the bench times exactly that. ``launch.stages(x, ...)`` returns
``[(stage name, zero-argument callable), ...]`` that together do the same work, so each stage can be timed alone.
A variant of a declared kernel family (``kernel_family``, :mod:`kernels.family`) answers for its source, its
knobs and how they resolve; ``family.variant(...)`` makes one.

Library kernels register themselves when their module is imported (``load_builtin()`` imports them);
``prototypes/`` files register theirs the same way, and are marked ``prototype`` (the bench runs them on request).
Nothing else is needed for the bench to find one.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernels.contract import Dims

# library modules whose import registers variants (kernels never imports tools/ or prototypes/)
BUILTIN_MODULES = (
    "kernels.warp_decode_cupy",
    "kernels.warp_decode_fp8",
    "kernels.warp_decode_numba",
    "kernels.warp_decode_numba_fp8",
    "kernels.expert_centric_path",
    "kernels.batched",
    "kernels.dispatch",
    "kernels.decode",  # the decode-step kernels register their sources (no variants)
)

Stage = tuple[str, Callable[[], None]]


@dataclass(frozen=True)
class Launch:
    """One layer's launch for fixed dims: ``launch(x, w13, w2, topk_ids, topk_weights, out)``.

    ``stages``: the same work as ``[(name, zero-argument callable), ...]`` (None: not split). ``params``: the
    resolved knobs it runs. ``workspace``: its preallocated buffers. ``reference_mode`` / ``quant``: the numerics
    its output reproduces when they differ from its variant's (auto-dispatch: the chosen path's). ``facts``:
    what else the build decided (auto-dispatch: ``choice``, ``choice_source``, ``policy``).
    """

    run: Callable[..., None]
    stages: Callable[..., list[Stage]] | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    workspace: Any = None
    reference_mode: str | None = None
    quant: str | None = None
    facts: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any) -> None:
        self.run(x, w13, w2, topk_ids, topk_weights, out)


@dataclass(frozen=True)
class Variant:
    name: str  # unique, "backend:what", e.g. "cupy:warp-decode"
    backend: str  # "cupy" or "numba"
    family: str  # "warp-decode", "warp-decode-batched", "expert-centric", or a prototype's name
    build: Callable[..., Launch]  # build(dims: Dims, **params) -> Launch
    reference_mode: str = "warp_decode"  # the reference.moe_decode mode it must reproduce
    quant: str | None = None  # for reference_mode="classical"
    params: dict[str, Any] = field(default_factory=dict)  # the knobs build() is called with
    description: str = ""
    baseline: bool = False  # the expert-centric path speedups are measured against
    grid: dict[str, list[Any]] = field(default_factory=dict)  # default sweep grid over build() params
    # optional one-time weight transform run outside the timing: prepack(w13, w2) -> (w13', w2');
    # launch then receives the prepacked weights in place of w13 and w2
    prepack: Callable[[Any, Any], tuple[Any, Any]] | None = None
    # optional: whether build() can run these dims (supports(dims, **params) -> bool); the harness records a
    # dims it cannot run as status "unsupported" instead of timing it
    supports: Callable[..., bool] | None = None
    # an experiment from prototypes/ (set by register() for variants registered there): not a library path
    prototype: bool = False
    # the weight format its kernels read (kernels.formats): the bench counts that format's bytes
    weight_format: str = "bf16"
    # the kernel family it launches (kernels.family.KernelFamily); None for a variant composing others
    kernel_family: Any = None

    @property
    def source(self) -> Any:
        """Its CUDA C (a ``kernels.compile.CudaSource``), or None (Numba, or composed of other variants)."""
        return self.kernel_family.source if self.kernel_family is not None else None

    def resolve(self, dims: Dims | None = None, **overrides: Any) -> dict[str, Any]:
        """The knobs ``make(dims, **overrides)`` runs, auto ones filled from ``dims`` by its family's rules."""
        params = {**self.params, **overrides}
        if self.kernel_family is None:
            return params
        known = self.kernel_family.defaults
        return {**params, **self.kernel_family.resolve(dims, **{k: v for k, v in params.items() if k in known})}

    def compiled_params(self, dims: Dims) -> dict[str, int] | None:
        """The macros its CUDA C compiles with at ``dims`` (knobs resolved, derived macros set), or None where it
        has no CUDA C or cannot run these dims."""
        source = self.source
        if source is None or not self.can_run(dims):
            return None
        try:
            params = self.resolve(dims)
        except ValueError:
            return None
        return {k: v for k, v in params.items() if k in source.defaults}

    def can_run(self, dims: Dims, **overrides: Any) -> bool:
        """Whether ``make(dims, **overrides)`` can run these dims (True for a variant without ``supports``)."""
        return self.supports is None or bool(self.supports(dims, **{**self.params, **overrides}))

    def make(self, dims: Dims, **overrides: Any) -> Launch:
        return self.build(dims, **{**self.params, **overrides})


REGISTRY: dict[str, Variant] = {}


def register(variant: Variant, *, prototype: bool | None = None) -> Variant:
    """Add (or replace) a variant; returns it so modules can write ``X = register(Variant(...))``.

    ``prototype``: None marks the variant a prototype when the module calling ``register`` lives in
    ``prototypes/``; True or False says so explicitly.
    """
    if not isinstance(variant, Variant):
        raise TypeError(f"register() takes a Variant, got {type(variant).__name__}")
    if prototype is None:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        prototype = variant.prototype or caller == "prototypes" or caller.startswith("prototypes.")
    if prototype != variant.prototype:
        variant = dataclasses.replace(variant, prototype=bool(prototype))
    REGISTRY[variant.name] = variant
    return variant


def load_builtin() -> dict[str, Variant]:
    """Import the library's kernel modules (each registers its variants); returns the registry. The programs load
    the prototypes too, through ``tools.registry.load``."""
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    return REGISTRY


def get_variant(name: str) -> Variant:
    load_builtin()
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown variant {name!r}; registered: {', '.join(sorted(REGISTRY))}") from None
