"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and are skipped cleanly where no GPU is present; tests of
the no-GPU flow (a CuPy stand-in, "NO TIMING TAKEN") carry ``@pytest.mark.cpu_only`` and are skipped where one is.
Tests over ~2 s on 2 CPU cores carry ``@pytest.mark.slow``: ``python -m pytest -m "not slow"`` is the quick subset.

A run keeps one folder of offline compile reports (``$WD_OFFLINE_REPORT_CACHE``, kernels/compile.py) and one of g++
emulators (``$WD_EMULATOR_CACHE``, tests/warp_checks.py), which the tools the tests start (the bench, the sweep)
share, so a text is compiled once per run; set either to keep it elsewhere (then it is not removed)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

CACHES = ("WD_OFFLINE_REPORT_CACHE", "WD_EMULATOR_CACHE")
_OWNED: list[str] = []  # the cache folders this process made (and removes at the end)


def _gpu_available() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device, no CuPy: no GPU
        return False


GPU = _gpu_available()


def pytest_configure(config: pytest.Config) -> None:
    for name in CACHES:
        if not os.environ.get(name):
            folder = tempfile.mkdtemp(prefix=f"{name.lower()}-")
            _OWNED.append(folder)
            os.environ[name] = folder


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _OWNED:
        shutil.rmtree(folder, ignore_errors=True)
    _OWNED.clear()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if GPU:
        skip = pytest.mark.skip(reason="needs a machine without a CUDA GPU (checks the no-GPU flow)")
        marker = "cpu_only"
    else:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        marker = "gpu"
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request: pytest.FixtureRequest):
    """A fresh generator per test, seeded from the test's name (reproducible, never shared)."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
