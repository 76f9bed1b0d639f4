"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and are skipped cleanly where no GPU is present; tests of
the no-GPU flow (a CuPy stand-in, "NO TIMING TAKEN") carry ``@pytest.mark.cpu_only`` and are skipped where one is.
Tests over ~2 s on 2 CPU cores carry ``@pytest.mark.slow``: ``python -m pytest -m "not slow"`` is the quick subset.

Without a GPU, where pytest-xdist is installed (the ``test`` extra), a run spreads over one worker process per CPU
(at most 8), handed a test at a time: each worker keeps to its own CPU (the Numba simulator and the g++ emulations
pin themselves to the first CPU of their process, see kernels/simt.py) and takes the slow tests first, so that the
quick ones fill the end. ``-n 0`` runs in one process, as does a run naming single tests (``file::test``) and every
run on a GPU machine (the GPU tests share one device); ``-n N`` or ``PYTEST_XDIST_AUTO_NUM_WORKERS`` set N.

A run keeps one folder of offline compile reports (``$WD_OFFLINE_REPORT_CACHE``, kernels/compile.py) and one of g++
emulators (``$WD_EMULATOR_CACHE``, tests/warp_checks.py), which the workers and the tools the tests start (the
bench, the sweep) share, so a text is compiled once per run; set either to keep it elsewhere (then it is not
removed)."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile

import pytest

MAX_WORKERS = 8
CACHES = ("WD_OFFLINE_REPORT_CACHE", "WD_EMULATOR_CACHE")
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_OWNED: list[str] = []  # the cache folders this process made (and removes at the end)


def _is_worker(config: pytest.Config) -> bool:
    """A pytest-xdist worker (not a pytest that a test started from one: that inherits PYTEST_XDIST_WORKER)."""
    return hasattr(config, "workerinput")


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


@functools.cache
def _gpu_available() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver, no device, no CuPy: no GPU
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Without ``-n`` / ``--dist``: ``-n auto --maxschedchunk 1`` (pytest_xdist_auto_num_workers below), unless the
    run names single tests only or pytest-xdist is not installed (then one process, as before)."""
    if _is_worker(config) or not config.pluginmanager.hasplugin("xdist") or config.option.collectonly:
        return
    if config.option.numprocesses is not None or config.option.dist != "no":
        return
    if config.args and all("::" in arg for arg in config.args):
        return
    config.option.numprocesses = "auto"
    if getattr(config.option, "maxschedchunk", 0) is None:
        # a test at a time (a worker holds at most two): tests take 0.01-40 s, and a worker that was handed a chunk
        # of slow tests up front kept the other waiting at the end (90 s against 53 s for one file)
        config.option.maxschedchunk = 1


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """One worker per CPU this process may use (at most MAX_WORKERS); none (one process) on a GPU machine or a
    single CPU. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides, as in pytest-xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    cpus = len(_cpus())
    return 0 if cpus < 2 or _gpu_available() else min(cpus, MAX_WORKERS)


def pytest_configure(config: pytest.Config) -> None:
    if _is_worker(config):
        if hasattr(os, "sched_setaffinity"):
            # Worker i on CPU i. The simulator's threads and the emulators' lanes hand over at every step, so each
            # simulation keeps to the first CPU of its process; on CPUs of their own, two workers' simulations run
            # side by side.
            cpus, number = _cpus(), config.workerinput["workerid"].removeprefix("gw")
            with contextlib.suppress(OSError):  # a restricted container: run as is
                os.sched_setaffinity(0, {cpus[int(number) % len(cpus) if number.isdigit() else 0]})
        return  # a worker uses its controller's folders (its environment is the controller's)
    if getattr(config.option, "numprocesses", None):
        # One BLAS thread per worker, set before the workers start: pytest imports Numba (and so NumPy and its
        # BLAS) to read pyproject's warning filters before this file is loaded, too early for a worker to pin itself
        # first, and a second BLAS thread spinning beside the other worker made NumPy-heavy tests 10-17x slower.
        for name in BLAS_THREADS:
            os.environ.setdefault(name, "1")
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
    if _gpu_available():
        skip = pytest.mark.skip(reason="needs a machine without a CUDA GPU (checks the no-GPU flow)")
        marker = "cpu_only"
    else:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        marker = "gpu"
    for item in items:
        if marker in item.keywords:
            item.add_marker(skip)
    if _is_worker(config):
        # every worker collects the same order; the slow tests first, so that the quick ones, not a 20-40 s test
        # started last, decide when the workers finish (a stable sort: each part keeps its files' order)
        items.sort(key=lambda item: "slow" not in item.keywords)


@pytest.fixture
def rng(request: pytest.FixtureRequest):
    """A fresh generator per test, seeded from the test's name (reproducible, never shared)."""
    import zlib

    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def emulated():
    """The emulated CuPy device (tests/emulated_device.py) for one test: ``import cupy`` and the lab's kernels run on
    the CPU inside it; yields the :class:`~tests.emulated_device.EmulatedDevice` (its launches)."""
    from tests.emulated_device import emulated_device

    with emulated_device() as device:
        yield device


@pytest.fixture
def cupy_mod():
    """CuPy on a CUDA GPU for a GPU test (skipped without one); afterwards the device synchronized and CuPy's memory
    pool emptied, so one test's buffers do not crowd the next."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("needs a CUDA GPU")
    except Exception:  # noqa: BLE001 - no driver: no GPU
        pytest.skip("needs a CUDA GPU")
    yield cupy
    cupy.cuda.runtime.deviceSynchronize()
    cupy.get_default_memory_pool().free_all_blocks()
