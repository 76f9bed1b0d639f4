"""Experiments that register themselves: every module in this folder is imported by ``load()``.

A prototype module builds a :class:`kernels.variants.Variant` (a CUDA source string or a Numba function,
its parameter grid, an optional weight prepack) and calls ``kernels.variants.register``. Its docstring
keeps what the experiment measured on the H200 and what it concluded.
"""

from __future__ import annotations

import importlib
import pkgutil


def load() -> list[str]:
    """Import every prototype module (registering its variants); returns their names."""
    names = []
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
            names.append(info.name)
    return names
