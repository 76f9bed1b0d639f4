"""Experiments that register themselves: every module in this folder is imported by ``load()``.

A prototype module declares its kernels once (a :class:`kernels.family.KernelFamily`: CUDA source, knobs, rules,
workspace, stages) and registers a variant of it with ``kernels.variants.register(FAMILY.variant(...))``. Its
docstring keeps the hypothesis, the result, the verdict and the results file.

Experiments kept outside the checkout load the same way: ``WARP_DECODE_PROTOTYPES`` (folders, separated by
``os.pathsep``) adds every ``*.py`` file in them whose name does not start with ``_``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

EXTRA_DIRS_ENV = "WARP_DECODE_PROTOTYPES"


def _load_file(path: Path) -> str:
    """Import one prototype file from outside this folder as ``prototypes.<stem>`` (so it registers as one)."""
    name = f"{__name__}.{path.stem}"
    if name in sys.modules:
        return path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return path.stem


def load() -> list[str]:
    """Import every prototype module (registering its variants), this folder's and those of
    ``$WARP_DECODE_PROTOTYPES``; returns their names."""
    names = []
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
            names.append(info.name)
    for folder in filter(None, os.environ.get(EXTRA_DIRS_ENV, "").split(os.pathsep)):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"{EXTRA_DIRS_ENV} names {folder!r}, which is not a folder")
        for path in sorted(Path(folder).glob("*.py")):
            if not path.name.startswith("_"):
                names.append(_load_file(path))
    return names
