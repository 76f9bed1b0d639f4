"""A kernel family declared once: the source, knobs and stages behind a set of variants.

A :class:`KernelFamily` states everything the lab needs to know about one set of kernels:

* its CUDA C (a :class:`~kernels.compile.CudaSource`; ``None`` for a Numba family, which states its
  ``offline_reports`` and ``simulate`` instead);
* its knobs: defaults, limits, which are "auto" (0) and the ``rules`` that fill those from a problem's dims and
  reject combinations that cannot run (:meth:`KernelFamily.resolve`);
* what it needs from the device (``device_needs``: knob -> minimum compute capability; below it the knob is 0);
* which kernels a knob set launches, its workspace and its stages.

``family.build(dims, **knobs)`` resolves the knobs, compiles the kernels once (cached per device, source text and
knob set), allocates the workspace once and returns a :class:`~kernels.variants.Launch`: call it with ``(x, w13,
w2, topk_ids, topk_weights, out)``; it allocates nothing and never syncs with the host, so a CUDA graph can capture
it. ``launch.stages(...)`` gives the same work as named zero-argument callables, each timed alone by the bench.

``family.variant(name, ...)`` makes the registry entry (:class:`kernels.variants.Variant`), which then carries the
family: the bench, the sweep and the compile report ask the variant for its source, knobs and resolver.

This module builds on :mod:`kernels.variants`, the registry, which defines ``Launch`` and ``Stage`` (what every
variant's ``build`` returns, a family's or not) and never imports this module; ``from kernels.family import Launch,
Stage`` keeps working.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kernels.compile import CudaSource, get_kernel, register_source, validate_knobs
from kernels.contract import Dims
from kernels.variants import Launch, Stage, Variant


@dataclass(frozen=True)
class Compiled:
    """A family resolved and compiled for one problem: what its stages launch."""

    family: KernelFamily
    dims: Dims
    params: dict[str, int]
    kernels: dict[str, Any]  # kernel name -> cupy.RawKernel (empty for a family without CUDA C)
    workspace: Any

    def stage_list(self, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any,
                   **layer: Any) -> list[Stage]:
        """The stages on these arrays; ``layer``: a family's own extra arrays (the batched families' ``b13`` /
        ``b2`` biases), passed through."""
        if self.family.stages is None:
            raise TypeError(f"kernel family {self.family.name!r} declares no stages")
        return self.family.stages(self, x, w13, w2, topk_ids, topk_weights, out, **layer)

    def run(self, x: Any, w13: Any, w2: Any, topk_ids: Any, topk_weights: Any, out: Any, **layer: Any) -> None:
        for _, stage in self.stage_list(x, w13, w2, topk_ids, topk_weights, out, **layer):
            stage()

    def launch(self) -> Launch:
        return Launch(run=self.run, stages=self.stage_list, params=self.params, workspace=self.workspace)


def _current_device() -> tuple[int, int]:
    """(device id, compute capability as major * 10 + minor) of CuPy's current device."""
    import cupy

    device = cupy.cuda.Device()
    return int(device.id), int(device.compute_capability)


@dataclass
class KernelFamily:
    """One kernel family, declared once (see the module docstring)."""

    name: str
    source: CudaSource | None = None
    knobs: dict[str, int] | None = None  # the knobs and their defaults when there is no source (else its defaults)
    limits: dict[str, tuple[int, int]] = field(default_factory=dict)
    auto_knobs: tuple[str, ...] = ()  # knobs for which 0 means "pick from the dims"
    # compile-time constants of the source that are not knobs: the rules set them from the dims (and the family's
    # fixed choices); a caller cannot set them, sweeps do not vary them, and they do not count as the family's knobs
    derived: tuple[str, ...] = ()
    # rules(dims or None, validated values) -> values: fills the auto knobs, rejects what cannot run (ValueError)
    rules: Callable[[Dims | None, dict[str, int]], dict[str, int]] | None = None
    device_needs: dict[str, int] = field(default_factory=dict)  # knob -> minimum compute capability (90 = sm_90)
    # kernel_names(params) -> the kernels a knob set launches, in stage order (default: every kernel the text defines)
    kernel_names: Callable[[dict[str, int]], tuple[str, ...]] | None = None
    workspace: Callable[[Dims, dict[str, int]], Any] | None = None  # workspace(dims, params) -> buffers
    stages: Callable[..., list[Stage]] | None = None  # stages(compiled, x, w13, w2, topk_ids, topk_weights, out)
    prepare: Callable[[dict[str, Any], dict[str, int]], None] | None = None  # once per compiled kernel set
    # families without CUDA C: their offline compile report (param_sets, defaults=) -> reports, and the
    # simulator self-check (cases, seed=) -> outcomes the bench's CPU path shows
    offline_reports: Callable[..., list[Any]] | None = None
    simulate: Callable[..., list[dict[str, Any]]] | None = None
    _cache: dict[tuple[Any, ...], dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.source is None and self.knobs is None:
            self.knobs = {}
        if self.source is not None and set(self.derived) - set(self.source.defaults):
            raise ValueError(f"kernel family {self.name!r}: derived names unknown macros "
                             f"{sorted(set(self.derived) - set(self.source.defaults))}")
        unknown = (set(self.limits) | set(self.auto_knobs) | set(self.device_needs)) - set(self.defaults)
        if unknown:
            raise ValueError(f"kernel family {self.name!r}: limits / auto_knobs / device_needs name unknown knobs "
                             f"{sorted(unknown)}")
        if self.source is not None:
            register_source(self.source)

    @property
    def defaults(self) -> dict[str, int]:
        """The family's knobs and their defaults (the source's macros but the derived ones)."""
        macros = self.source.defaults if self.source is not None else self.knobs or {}
        return {knob: value for knob, value in macros.items() if knob not in self.derived}

    def resolve(self, dims: Dims | None = None, **knobs: Any) -> dict[str, int]:
        """Every knob as an int: ``knobs`` validated against the defaults and limits (ValueError / TypeError name
        the knob), auto knobs filled by ``rules`` from ``dims`` (without dims, the rules' dims-free choice)."""
        if dims is not None and not isinstance(dims, Dims):
            raise TypeError(f"dims must be a kernels.contract.Dims, got {type(dims).__name__}")
        values = validate_knobs(self.name, knobs, self.defaults, self.limits, self.auto_knobs)
        if self.derived and self.source is not None:
            values.update({name: self.source.defaults[name] for name in self.derived})
        return self.rules(dims, values) if self.rules is not None else values

    def for_device(self, params: dict[str, int]) -> dict[str, int]:
        """``params`` for the current device: each knob the device is too old for (``device_needs``) becomes 0."""
        wanted = [knob for knob in self.device_needs if params.get(knob)]
        if not wanted:
            return params
        _, capability = _current_device()
        return {**params, **{knob: 0 for knob in wanted if capability < self.device_needs[knob]}}

    def kernels_for(self, params: dict[str, int]) -> dict[str, Any]:
        """The kernels these resolved knobs launch (``kernel_names``), compiled once per device, source text and
        knob set -- the key holds the text, so an edited ``source.code`` (IPython) compiles afresh."""
        if self.source is None:
            return {}
        device, _ = _current_device()
        names = self.kernel_names(params) if self.kernel_names else self.source.compiled_kernels(**params)
        key = (device, self.source.code, tuple(sorted(params.items())), tuple(names))
        kernels = self._cache.get(key)
        if kernels is None:
            kernels = {name: get_kernel(self.source, name, **params) for name in names}
            if self.prepare is not None:
                self.prepare(kernels, params)
            self._cache[key] = kernels
        return kernels

    def compile(self, dims: Dims, workspace: Any = None, **knobs: Any) -> Compiled:
        """Resolve for ``dims`` and this device, compile, and allocate the workspace unless one is given."""
        params = self.for_device(self.resolve(dims, **knobs))
        kernels = self.kernels_for(params)
        if workspace is None and self.workspace is not None:
            workspace = self.workspace(dims, params)
        return Compiled(self, dims, params, kernels, workspace)

    def build(self, dims: Dims, **knobs: Any) -> Launch:
        """What a variant's ``build`` is: compile once, allocate once, return the launch."""
        return self.compile(dims, **knobs).launch()

    def variant(self, name: str, *, backend: str = "cupy", family: str | None = None, knobs: Mapping[str, Any] = (),
                build: Callable[..., Launch] | None = None, **fields: Any) -> Variant:
        """A :class:`~kernels.variants.Variant` of this family: ``params`` are the defaults with the auto knobs
        left to the rules, updated by ``knobs``; ``build`` defaults to :meth:`build`. Register it with
        ``register(family.variant(...))``."""
        params = {**self.defaults, **{knob: 0 for knob in self.auto_knobs}, **dict(knobs)}
        return Variant(name=name, backend=backend, family=family or self.name, build=build or self.build,
                       params=params, kernel_family=self, **fields)
