"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and are skipped cleanly where no GPU is present; tests of
the no-GPU flow (a CuPy stand-in, "NO TIMING TAKEN") carry ``@pytest.mark.cpu_only`` and are skipped where one is.
Tests over ~2 s on 2 CPU cores carry ``@pytest.mark.slow``: ``python -m pytest -m "not slow"`` is the quick subset."""

from __future__ import annotations

import os

import pytest


def _gpu_available() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device, no CuPy: no GPU
        return False


GPU = _gpu_available()


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
