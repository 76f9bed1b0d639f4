"""Auto-dispatch (kernels/dispatch.py) and the table tool (tools/dispatch_table.py).

CPU: slugs, the heuristic, table lookup (nearest lower point, unknown shape / GPU -> heuristic), table
validation, the tool's winner / merge logic, that the H200 uses the heuristic until a measured table is
committed, input errors before any device call, the variant registration.
GPU: moe_decode equals the chosen path bitwise; capture of moe_decode and of the ``cupy:auto`` variant
(a decision that synced with the host would break the capture); replay on new routing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels import dispatch
from kernels.contract import BF16, Dims
from kernels.problem import make_problem
from kernels.shapes import PRESETS
from tests.test_warp_decode_batched import (
    FakeCupyArray,
    _assert_matches,
    _poisoned_out,
    _references,
    _seed,
    write_fresh_inputs,
)
from tools import dispatch_table

QWEN30 = PRESETS["qwen3-30b-a3b"]


def _dims(shape: Any, tokens: int) -> Dims:
    return Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)


def _record(median: float | None, status: str = "ok") -> dict[str, Any]:
    return {"median_us": median, "status": status, "tbps": None, "bytes": {"unique_experts": 8}}


def _write_table(directory: Path, gpu: str, shape: Any, choices: dict[int, str]) -> Path:
    table = None
    for tokens, choice in choices.items():
        other = dispatch.BATCHED if choice == dispatch.STRICT else dispatch.STRICT
        point = dispatch_table.point_record({choice: _record(10.0), other: _record(11.0)})
        table = dispatch_table.merge(table, gpu, {"date": "2026-11-30T00:00:00+00:00"}, shape.name,
                                     _dims(shape, tokens), tokens, point)
    path = directory / f"{dispatch.gpu_slug(gpu)}.json"
    path.write_text(json.dumps(table))
    dispatch.load_table.cache_clear()
    return path


def test_gpu_slug() -> None:
    assert dispatch.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert dispatch.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    with pytest.raises(ValueError, match="GPU name"):
        dispatch.gpu_slug("  ")


def test_heuristic() -> None:
    choices = {t: dispatch.heuristic(_dims(QWEN30, t)) for t in (1, 2, 3, 4, 8, 64)}
    assert choices == {1: dispatch.STRICT, 2: dispatch.STRICT, 3: dispatch.BATCHED, 4: dispatch.BATCHED,
                       8: dispatch.BATCHED, 64: dispatch.BATCHED}
    big = _dims(QWEN30, 4096)  # beyond the batched down kernel's shared memory
    assert not dispatch.batched_supported(big) and dispatch.heuristic(big) == dispatch.STRICT
    mixtral = PRESETS["mixtral-8x7b"]  # E = 8, K = 2: T=1 shares nothing, T=2 already does
    assert dispatch.heuristic(_dims(mixtral, 1)) == dispatch.STRICT
    assert dispatch.heuristic(_dims(mixtral, 2)) == dispatch.BATCHED


def test_table_lookup(tmp_path: Path) -> None:
    gpu = "Fake GPU 9000"
    _write_table(tmp_path, gpu, QWEN30, {1: dispatch.STRICT, 2: dispatch.BATCHED, 8: dispatch.STRICT,
                                         64: dispatch.BATCHED})
    want = {1: dispatch.STRICT, 2: dispatch.BATCHED, 3: dispatch.BATCHED, 7: dispatch.BATCHED,
            8: dispatch.STRICT, 63: dispatch.STRICT, 64: dispatch.BATCHED, 200: dispatch.BATCHED}
    for tokens, choice in want.items():
        assert dispatch.choose(_dims(QWEN30, tokens), gpu, tmp_path) == (choice, "table"), tokens
    # batched chosen by the table but impossible at this T: heuristic (strict)
    assert dispatch.choose(_dims(QWEN30, 4096), gpu, tmp_path) == (dispatch.STRICT, "heuristic")
    # a shape the table does not hold, or a GPU without a table: heuristic
    other = PRESETS["qwen3-235b-a22b"]
    assert dispatch.choose(_dims(other, 64), gpu, tmp_path) == (dispatch.BATCHED, "heuristic")
    assert dispatch.choose(_dims(QWEN30, 1), "Other GPU", tmp_path) == (dispatch.STRICT, "heuristic")


def test_table_lower_bound_below_first_point(tmp_path: Path) -> None:
    gpu = "Fake GPU 2"
    _write_table(tmp_path, gpu, QWEN30, {4: dispatch.BATCHED, 16: dispatch.STRICT})
    assert dispatch.choose(_dims(QWEN30, 1), gpu, tmp_path) == (dispatch.BATCHED, "table")  # first point


def test_h200_uses_the_heuristic_until_a_measured_table_exists() -> None:
    """No table is ever written by hand: the H200 uses the heuristic until tools.dispatch_table has run there."""
    dispatch.load_table.cache_clear()
    measured = (dispatch.TABLE_DIR / "nvidia-h200.json").is_file()
    for tokens in (1, 8, 64):
        choice, source = dispatch.choose(_dims(QWEN30, tokens), "NVIDIA H200")
        assert source == ("table" if measured else "heuristic")
        if not measured:
            assert choice == dispatch.heuristic(_dims(QWEN30, tokens))


def test_committed_tables_are_valid_measurements() -> None:
    for path in sorted(dispatch.TABLE_DIR.glob("*.json")):
        table = dispatch.validate_table(json.loads(path.read_text()))
        assert path.stem == dispatch.gpu_slug(table["gpu"]) == table["slug"], path
        assert table["environment"]["gpu"]["name"] == table["gpu"], f"{path}: not measured on {table['gpu']}"
        for key, entry in table["entries"].items():
            for tokens, point in entry["points"].items():
                medians = {n: t for n, t in point["median_us"].items() if n in dispatch.CANDIDATES and t}
                assert point["choice"] == min(medians, key=medians.get), (path, key, tokens)


def test_validate_table_rejects_bad_tables() -> None:
    with pytest.raises(ValueError, match="schema"):
        dispatch.validate_table({"gpu": "x"})
    good = {"schema": dispatch.SCHEMA, "gpu": "g", "date": "d",
            "entries": {"k": {"points": {"1": {"choice": dispatch.STRICT}}}}}
    assert dispatch.validate_table(good) is good
    bad = json.loads(json.dumps(good))
    bad["entries"]["k"]["points"]["1"]["choice"] = "cupy:expert-centric"
    with pytest.raises(ValueError, match="choice"):
        dispatch.validate_table(bad)
    bad["entries"]["k"]["points"] = {"zero": {"choice": dispatch.STRICT}}
    with pytest.raises(ValueError, match="batch size"):
        dispatch.validate_table(bad)


def test_tool_winner_and_point() -> None:
    records = {dispatch.STRICT: _record(12.0), dispatch.BATCHED: _record(10.0, "wrong"),
               "cupy:expert-centric": _record(5.0)}
    assert dispatch_table.winner(records) == dispatch.STRICT  # wrong results and non-candidates never win
    records[dispatch.BATCHED]["status"] = "ok"
    point = dispatch_table.point_record(records)
    assert point["choice"] == dispatch.BATCHED
    assert point["slowdown_of_others"][dispatch.STRICT] == pytest.approx(1.2)
    assert dispatch_table.point_record({dispatch.STRICT: _record(None, "error")}) is None


def test_tool_refuses_without_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools import harness

    if harness.gpu_available()[0]:
        pytest.skip("a GPU is present")
    assert dispatch_table.main(["--json", str(tmp_path / "x.json"), "--model", "tiny", "--batch", "1"]) == 2
    assert not (tmp_path / "x.json").exists()


def test_input_errors_before_any_device_call() -> None:
    problem = make_problem("tiny", 2, seed=1)
    with pytest.raises(TypeError, match="cupy"):
        dispatch.moe_decode(*problem.arrays)
    fakes = [FakeCupyArray(a.shape, a.dtype) for a in problem.arrays]
    with pytest.raises(TypeError, match="workspace"):
        dispatch.moe_decode(*fakes, workspace=object())
    ws = dispatch.Workspace(_dims(problem.shape, 3), dispatch.STRICT, "heuristic", None)
    with pytest.raises(ValueError, match="workspace was made for"):
        dispatch.moe_decode(*fakes, workspace=ws)
    fakes[3] = FakeCupyArray((2, 2), np.int64)
    with pytest.raises(TypeError, match="topk_ids"):
        dispatch.moe_decode(*fakes)
    with pytest.raises(TypeError, match="Dims"):
        dispatch.choose((1, 2, 3, 4, 5), "NVIDIA H200")


def test_variant_registered() -> None:
    from kernels.variants import REGISTRY

    variant = REGISTRY["cupy:auto"]
    assert variant.reference_mode == "warp_decode" and variant.params == {}
    with pytest.raises(ValueError, match="no knobs"):
        variant.build(_dims(QWEN30, 1), GB_OUTS=2)


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def cupy_mod():
    import cupy

    yield cupy
    cupy.get_default_memory_pool().free_all_blocks()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 3, 8, 64])
def test_moe_decode_equals_chosen_path(cupy_mod: Any, rng: np.random.Generator, tokens: int) -> None:
    from kernels import warp_decode_batched as wdb
    from kernels import warp_decode_cupy as wdc

    cupy = cupy_mod
    problem = make_problem("qwen3-30b-a3b", tokens, seed=_seed(rng), xp=cupy)
    dims = _dims(problem.shape, tokens)
    ws = dispatch.make_workspace(dims)
    out = _poisoned_out(cupy, tokens, dims.hidden)
    assert dispatch.moe_decode(*problem.arrays, out=out, workspace=ws) is out
    cupy.cuda.runtime.deviceSynchronize()
    path = wdb.warp_decode_batched if ws.choice == dispatch.BATCHED else wdc.warp_decode
    expected = cupy.asnumpy(path(*problem.arrays)).view(np.uint16)
    assert np.array_equal(cupy.asnumpy(out).view(np.uint16), expected), ws.choice
    faithful, oracle = _references(problem)
    _assert_matches(cupy.asnumpy(out), faithful, oracle, f"auto T={tokens} ({ws.choice}, {ws.source})")
    allocating = dispatch.moe_decode(*problem.arrays)
    assert allocating.dtype == BF16 and np.array_equal(cupy.asnumpy(allocating).view(np.uint16), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [2, 16])
def test_capture_moe_decode_and_auto_variant(cupy_mod: Any, rng: np.random.Generator, tokens: int) -> None:
    cupy = cupy_mod
    problem = make_problem("qwen3-30b-a3b", tokens, seed=_seed(rng), xp=cupy)
    dims = _dims(problem.shape, tokens)
    ws = dispatch.make_workspace(dims)
    launch = dispatch.VARIANT.make(dims)
    assert launch.choice == ws.choice and launch.choice_source == ws.source
    outs = [_poisoned_out(cupy, tokens, dims.hidden) for _ in range(2)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        dispatch.moe_decode(*problem.arrays, out=outs[0], workspace=ws)  # compile outside the capture
        launch(*problem.arrays, outs[1])
        stream.synchronize()
        for o in outs:
            o.view(cupy.uint16).fill(0x7FC0)
        stream.synchronize()
        dispatch.load_table.cache_clear()
        dispatch._device_name.cache_clear()
        stream.begin_capture()
        assert dispatch.choose(dims) == (ws.choice, ws.source)  # the decision itself is capture-safe
        dispatch.moe_decode(*problem.arrays, out=outs[0], workspace=ws)  # no host sync
        launch(*problem.arrays, outs[1])
        graph = stream.end_capture()
    for round_ in range(2):
        with stream:
            graph.launch(stream)
            stream.synchronize()
        faithful, oracle = _references(problem)
        for o, what in zip(outs, ("moe_decode", "cupy:auto"), strict=True):
            _assert_matches(cupy.asnumpy(o), faithful, oracle, f"{what} replay {round_} T={tokens}")
        write_fresh_inputs(cupy, problem, _seed(rng))
        for o in outs:
            o.view(cupy.uint16).fill(0x7FC0)


def test_table_from_a_bench_run() -> None:
    """--from-bench turns a bench JSON into a table: the faster correct candidate per (model, batch)."""
    from tools import dispatch_table

    def row(variant: str, batch: int, median: float, status: str = "ok") -> dict:
        return {"model": "qwen3-30b-a3b", "variant": variant, "batch": batch, "median_us": median, "status": status,
                "tbps": 1.0, "bytes": {"unique_experts": 8}}

    env = {"date": "2026-11-30T00:00:00Z", "gpu": {"name": "NVIDIA H200"}}
    bench = {"environment": env, "config": {"routing": "uniform"}, "results": [
        row(dispatch.STRICT, 1, 26.0), row(dispatch.BATCHED, 1, 28.0),
        row(dispatch.STRICT, 8, 140.0), row(dispatch.BATCHED, 8, 130.0),
        row(dispatch.STRICT, 64, 900.0), row(dispatch.BATCHED, 64, 500.0, status="wrong"),
        row("cupy:expert-centric", 64, 400.0),  # never a candidate
    ]}
    table = dispatch_table.from_bench(bench)
    points = next(iter(table["entries"].values()))["points"]
    assert {t: p["choice"] for t, p in points.items()} == {"1": dispatch.STRICT, "8": dispatch.BATCHED,
                                                            "64": dispatch.STRICT}
    assert table["gpu"] == table["environment"]["gpu"]["name"] == "NVIDIA H200"
    with pytest.raises(ValueError, match="uniform"):
        dispatch_table.from_bench({**bench, "config": {"routing": "zipf"}})
