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
