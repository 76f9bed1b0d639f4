"""Every public entry point of ``kernels`` stays what it is whatever was imported before it: no submodule of the
library shadows a public function (``kernels.expert_centric`` once became its module after ``moe_decode`` ran), and
no program module shadows the standard library."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _import_everything() -> list[str]:
    names = []
    for package in ("kernels", "tools", "prototypes"):
        module = importlib.import_module(package)
        for info in pkgutil.iter_modules(module.__path__):
            names.append(f"{package}.{info.name}")
            importlib.import_module(f"{package}.{info.name}")
    return names


def test_public_functions_stay_callable_after_every_import() -> None:
    import kernels

    public = {name: getattr(kernels, name) for name in kernels.__all__}
    _import_everything()
    for name, value in public.items():
        assert getattr(kernels, name) is value, f"kernels.{name} was replaced by {getattr(kernels, name)!r}"
    for name in ("expert_centric", "moe_decode", "warp_decode", "make_problem", "route", "get_shape"):
        assert callable(getattr(kernels, name)) and not isinstance(getattr(kernels, name), type(sys)), name


def test_entry_points_refuse_host_arrays_cleanly_after_every_import() -> None:
    """Called, not only looked up: each GPU entry point answers NumPy inputs with a TypeError of its own."""
    import kernels

    _import_everything()
    problem = kernels.make_problem("tiny", 2, seed=3)
    for entry in (kernels.expert_centric, kernels.moe_decode):
        with pytest.raises(TypeError, match="cupy"):
            entry(*problem.arrays)


def test_no_module_shadows_the_standard_library() -> None:
    names = {name.split(".", 1)[1] for name in _import_everything()}
    assert not names & set(sys.stdlib_module_names), sorted(names & set(sys.stdlib_module_names))


def test_warp_decode_takes_fp8_weights_to_the_backends_strict_fp8_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels
    import kernels.warp_decode_fp8 as cupy_fp8
    import kernels.warp_decode_numba_fp8 as numba_fp8

    problem = kernels.make_problem("tiny", 2, seed=3)
    q13, q2 = kernels.quantize_weights(problem.w13, problem.w2, "fp8-block128")
    for backend, module in (("cupy", cupy_fp8), ("numba", numba_fp8)):
        calls: list[tuple[tuple, dict]] = []
        monkeypatch.setattr(module, "warp_decode_fp8",
                            lambda *a, _calls=calls, _name=backend, **k: _calls.append((a, k)) or _name)
        got = kernels.warp_decode(problem.x, q13, q2, problem.topk_ids, problem.topk_weights, backend=backend,
                                  GU_WARPS=2)
        assert got == backend and len(calls) == 1
        args, knobs = calls[0]
        assert args[1] is q13 and args[2] is q2 and knobs["GU_WARPS"] == 2
    with pytest.raises(TypeError, match="cupy"):  # bf16 weights still reach the bf16 kernels
        kernels.warp_decode(*problem.arrays)
    with pytest.raises(ValueError, match="backend"):
        kernels.warp_decode(problem.x, q13, q2, problem.topk_ids, problem.topk_weights, backend="triton")
