"""The bench without a GPU: bytes accounting, roofline arithmetic, harness helpers, CLI errors, the CPU path.
GPU tests (``-m gpu``) run the harness for real on the ``tiny`` shape, including a captured fallback."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels.contract import BF16
from kernels.routing import make_routing
from kernels.shapes import get_shape
from tools import gpu, harness, roofline, sweep
from tools.bench import _as_list, build_parser, main, select_variants

ROOT = Path(__file__).resolve().parents[1]
CPU_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """A subprocess; ``timeout`` only guards against a hang (10x what the slowest call takes on a busy 2-core
    machine), it is not a speed check."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


# -- bytes accounting --------------------------------------------------------------------------------
def test_bytes_counts_unique_experts_of_this_routing():
    shape = get_shape("qwen3-30b-a3b")
    ids = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 8, 9, 10, 11]], np.int32)
    b = harness.bytes_breakdown(shape, ids)
    assert b["unique_experts"] == 12
    assert b["weights"] == 12 * 3 * 2048 * 768 * 2
    assert b["activation"] == 2 * 2048 * 2 and b["output"] == 2 * 2048 * 2
    assert b["intermediate"] == 2 * 2 * 8 * 768 * 2
    assert b["activation"] + b["intermediate"] + b["output"] == shape.activation_bytes(2)
    assert b["total"] == b["weights"] + shape.activation_bytes(2)
    assert b["divisor"] == "weights"


@pytest.mark.parametrize("routing", ["uniform", "zipf", "same"])
def test_bytes_follow_the_routing(routing):
    shape = get_shape("tiny")
    ids, _ = make_routing(5, shape.experts, shape.top_k, routing, 3)
    b = harness.bytes_breakdown(shape, ids)
    assert b["unique_experts"] == len(np.unique(ids))
    assert b["weights"] == b["unique_experts"] * shape.expert_bytes
    if routing == "same":
        assert b["unique_experts"] == shape.top_k


# -- roofline arithmetic -------------------------------------------------------------------------------
def test_tbps_and_percent():
    assert roofline.tbps(4.56e12 * 1e-3, 1000.0) == pytest.approx(4.56)
    assert roofline.percent(2.28, 4.56) == pytest.approx(50.0)
    assert roofline.percent(None, 4.56) is None and roofline.percent(1.0, None) is None
    assert roofline.percent(1.0, 0.0) is None
    with pytest.raises(ValueError):
        roofline.tbps(1.0, 0.0)


def test_bar_widths_and_fill():
    assert roofline.bar(0, 10) == " " * 10
    assert roofline.bar(100, 10) == "█" * 10
    assert roofline.bar(150, 10) == "█" * 10  # clamped
    assert roofline.bar(50, 10) == "█" * 5 + " " * 5
    assert roofline.bar(55, 10) == "█" * 5 + "▌" + " " * 4
    assert all(len(roofline.bar(p, 16)) == 16 for p in np.linspace(0, 100, 41))
    assert roofline.bar(None, 7) == " " * 7


def test_datasheet_table():
    assert roofline.datasheet_tbps("NVIDIA H200") == 4.8
    assert roofline.datasheet_tbps("NVIDIA H100 80GB HBM3") == 3.35
    assert roofline.datasheet_tbps("NVIDIA H100 PCIe") == 2.0
    assert roofline.datasheet_tbps("Some Future GPU") is None


def test_roofline_source_is_registered_for_inspect():
    from kernels.compile import SOURCES

    assert SOURCES["roofline"] is roofline.ROOFLINE_SOURCE
    assert set(roofline.ROOFLINE_SOURCE.kernels) == {"stream_read", "copy16"}


# -- harness helpers ------------------------------------------------------------------------------------
def test_summarize():
    s = harness.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median_us"], s["min_us"], s["max_us"]) == (3.0, 1.0, 5.0)
    assert s["iqr_us"] == pytest.approx(2.0)
    assert harness.summarize([7.0])["iqr_us"] == 0.0
    with pytest.raises(ValueError):
        harness.summarize([])


def test_copies_needed_covers_three_l2():
    l2 = 60 << 20
    assert harness.copies_needed(10 << 30, l2) == 2  # never fewer than two
    assert harness.copies_needed(75 << 20, l2) == 3
    assert harness.copies_needed(9 << 20, l2) == 20
    for unique in (1 << 20, 7 << 20, 100 << 20):
        n = harness.copies_needed(unique, l2)
        assert n * unique >= 3 * l2


def test_bytes_of_several_draws_are_their_mean():
    from kernels.shapes import get_shape

    shape = get_shape("tiny")
    one = np.array([[0, 1], [0, 2]], np.int32)  # 3 experts
    two = np.array([[3, 3], [3, 3]], np.int32)  # 1 expert
    single = harness.bytes_breakdown(shape, one)
    assert single["unique_experts"] == 3 and single["routing_draws"] == 1
    both = harness.bytes_breakdown(shape, np.stack([one, two]))
    assert both["unique_experts"] == 2.0 and (both["unique_experts_min"], both["unique_experts_max"]) == (1, 3)
    assert both["routing_draws"] == 2 and both["weights"] == 2.0 * shape.expert_bytes


def test_draw_seeds_are_distinct_per_sample_and_copy():
    seeds = {harness.draw_seed(0, s, c) for s in range(30) for c in range(20)}
    assert len(seeds) == 600 and harness.draw_seed(0, 1, 2) == harness.draw_seed(0, 1, 2)
    assert harness.draw_seed(1, 1, 2) != harness.draw_seed(0, 1, 2)


def test_each_copy_carries_its_own_scales(emulated):
    """A copy's weights, and the reference's compact copy of them, hold that copy's scales and per-expert global
    scales (nvfp4's): on the H200 every nvfp4 row of the bench was checked wrong while the kernels read copy 0's
    globals. Pools made here by hand (no kernel runs)."""
    import cupy

    from kernels.formats import Quantized

    bench = object.__new__(harness.Workbench)  # only what weights() and _compact_copy() read
    bench.shape, copies = get_shape("tiny"), 3
    experts = bench.shape.experts
    rng = np.random.default_rng(5)

    def matrix(rows: int, cols: int) -> Quantized:
        return Quantized(cupy.asarray(rng.integers(0, 256, (copies * experts, rows, cols // 2), dtype=np.uint8)),
                         cupy.asarray(rng.integers(0, 256, (copies * experts, rows, cols // 16), dtype=np.uint8)),
                         global_scale=cupy.asarray(rng.random(copies * experts, dtype=np.float32)))

    pool = (matrix(2 * bench.shape.intermediate, bench.shape.hidden), matrix(bench.shape.hidden, 64))
    bench.pools, bench._compact = {"nvfp4": pool}, {}
    bench.check_token_ids = np.arange(2)
    bench.host = {"x": np.zeros((2, bench.shape.hidden), BF16), "topk_ids": np.array([[3, 1], [0, 3]], np.int32),
                  "topk_weights": np.ones((2, 2), np.float32)}
    for copy in range(copies):
        rows = slice(copy * experts, (copy + 1) * experts)
        for view, whole in zip(bench.weights(copy, "nvfp4"), pool, strict=True):
            for part in ("values", "scales", "global_scale"):
                assert np.array_equal(cupy.asnumpy(getattr(view, part)), cupy.asnumpy(getattr(whole, part)[rows]))
        compact = bench._compact_copy(copy, "nvfp4")
        for name, whole in zip(("w13", "w2"), pool, strict=True):
            touched = copy * experts + np.array([0, 1, 3])
            assert compact[name].values.dtype == np.uint8
            for part in ("values", "scales", "global_scale"):
                assert np.array_equal(getattr(compact[name], part), cupy.asnumpy(getattr(whole, part))[touched])


def test_check_tokens_fit_the_host_budget(rng):
    ids = np.stack([rng.permutation(256)[:8] for _ in range(64)]).astype(np.int32)
    assert harness.check_tokens(ids, 1, limit=10**9).size == 64
    chosen = harness.check_tokens(ids, expert_bytes=100, limit=100 * 32)
    assert 1 <= chosen.size < 64 and 0 in chosen
    assert np.unique(ids[chosen]).size <= 32
    assert harness.check_tokens(ids, expert_bytes=10**9, limit=1).size == 1  # always at least one


def test_compare_catches_unwritten_and_wrong_outputs(rng):
    ref = rng.standard_normal((4, 64)).astype(np.float32).astype(BF16)
    ok = harness.compare(ref.copy(), ref, None)
    assert ok["ok"] and ok["max_ulp"] == 0 and ok["all_written"]
    poisoned = ref.copy()
    poisoned[2, 5] = np.nan
    bad = harness.compare(poisoned, ref, None)
    assert not bad["ok"] and not bad["all_written"]
    wrong = (ref.astype(np.float32) * 1.1).astype(BF16)
    assert not harness.compare(wrong, ref, None)["ok"]


def test_environment_without_gpu_never_imports_numba():
    code = ("import sys; from tools import harness, bench, report, sweep; "
            "print(harness.environment(False)['numba'] is not None, 'numba' in sys.modules)")
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


# -- CLI ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--batch", "0"], "batch sizes must be ints >= 1"),
    (["--batch", "1,x"], "comma list of ints"),
    (["--model", "nope"], "unknown preset"),
    (["--routing", "random"], "invalid choice"),
    (["--repeats", "0"], "expected an int >= 1"),
])
def test_cli_argument_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_unknown_variant_exits_2():
    result = _run("-m", "tools.bench", "--variants", "no-such-variant*", "--batch", "1")
    assert result.returncode == 2
    assert "no registered variant matches 'no-such-variant*'" in result.stderr
    assert "Traceback" not in result.stderr


def test_parser_defaults():
    args = build_parser().parse_args([])
    assert args.model == "qwen3-30b-a3b" and args.batch == [1, 2, 4, 8, 16, 32, 64] and args.routing == "uniform"
    assert _as_list("a,b,,c") == ["a", "b", "c"]


def test_select_variants_by_name_and_glob():
    from types import SimpleNamespace as V

    registry = {"cupy:a": "A", "cupy:b": "B", "numba:a": "C"}
    assert select_variants(registry, ["cupy:*"]) == ["A", "B"]
    assert select_variants(registry, ["*:a", "cupy:a"]) == ["A", "C"]
    with pytest.raises(ValueError, match="registered: cupy:a"):
        select_variants(registry, ["x"])
    quick = {name: V(name=name, prototype=False) for name in ("cupy:auto", "cupy:warp-decode", "cupy:expert-centric",
                                                              "numba:warp-decode", "cupy:warp-decode-mma")}
    quick["proto:x"] = V(name="proto:x", prototype=True)
    quick["triton:fused-moe"] = V(name="triton:fused-moe", prototype=False)
    names = [v.name for v in select_variants(quick, None, prototypes=False)]  # the default: a minute on a GPU
    assert names == ["cupy:auto", "cupy:warp-decode", "cupy:expert-centric", "triton:fused-moe"]
    no_gpu = [v.name for v in select_variants(quick, None, prototypes=False, gpu=False)]
    assert "numba:warp-decode" in no_gpu  # what the simulator can run
    assert [v.name for v in select_variants(quick, None, prototypes=True)][-2:] == ["proto:x", "triton:fused-moe"]
    every = [v.name for v in select_variants(quick, "all", prototypes=False)]  # the library's paths, no peer
    assert every == [*names[:3], "numba:warp-decode", "cupy:warp-decode-mma"]


def test_list_names_every_variant_and_marks_the_default(capsys):
    from tools import bench

    assert bench.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "* cupy:auto " in out and "  cupy:warp-decode-mma " in out and "proto:fused-layer" in out
    assert not any(line.endswith(" ") for line in out.splitlines())


def test_all_and_variants_exclude_each_other():
    result = _run("-m", "tools.bench", "--all", "--variants", "cupy:auto")
    assert result.returncode == 2 and "give one" in result.stderr


# -- the CPU path end to end -----------------------------------------------------------------------------
@pytest.mark.cpu_only
def test_cpu_path_end_to_end(tmp_path):
    """The README's first command without a GPU: progress from the start, the checks of the default selection (the
    Numba strict kernels added, which the simulator runs), a one-line-per-kernel compile report, no number cut short
    in a pipe, "NO TIMING TAKEN"."""
    out = tmp_path / "cpu.json"
    result = _run("-m", "tools.bench", "--batch", "1,4", "--json", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.splitlines()[0].endswith("looking for a CUDA GPU")  # the first line, before any import
    assert "no usable CUDA GPU: no CUDA driver" in result.stderr or "no usable CUDA GPU: no GPU" in result.stderr
    assert "NO TIMING TAKEN" in result.stdout and "…" not in result.stdout
    data = json.loads(out.read_text())
    assert data["results"] == [] and data["rooflines"] is None and data["environment"]["gpu"] is None
    assert not any(name.startswith("proto:") for name in data["config"]["variants"])  # prototypes on request
    cpu = data["cpu"]
    assert data["config"]["variants"] == ["cupy:warp-decode", "numba:warp-decode", "cupy:expert-centric", "cupy:auto"]
    assert {r["mode"] for r in cpu["reference"]} == {"warp_decode", "classical"}
    assert all(r["rel_l2"] < 0.1 for r in cpu["reference"])
    assert [r["batch"] for r in cpu["expected_bytes"]] == [1, 4]
    assert cpu["simulator"]["status"] == "ok" and [c["case"] for c in cpu["simulator"]["cases"]] == [
        "numba:warp-decode tiny T=1"]
    kernels = {(row["variant"], row["kernel"]) for row in cpu["compile"]}
    assert ("numba:warp-decode", "moe_down_3d_batched") in kernels
    assert ("cupy:warp-decode", "moe_gate_up_3d_batched") in kernels
    assert all(not row["error"] and not row["spill_stores"] for row in cpu["compile"]), cpu["compile"]
    assert len(kernels) == len(cpu["compile"])  # one line per kernel
    rendered = _run("-m", "tools.report", str(out))
    assert rendered.returncode == 0 and "NO TIMING TAKEN" in rendered.stdout


def test_cpu_checks_follow_the_selection():
    """--variants / --batch narrow the CPU path: the reference runs in the selected variants' modes only, at the
    requested batches; no Numba variant selected, no simulator run."""
    from tools import bench

    base = _reference_variant("fake:fp8")
    fp8 = type(base)(**{**base.__dict__, "reference_mode": "classical", "quant": "fp8"})
    cpu = bench.cpu_checks(["tiny", "qwen3-30b-a3b"], [3, 2], "uniform", 0, "no GPU here", [fp8], "none")
    assert cpu["simulator"]["status"] == "none" and cpu["simulator"]["cases"] == []
    assert [(r["mode"], r["batch"]) for r in cpu["reference"]] == [("classical+fp8", 3), ("classical+fp8", 2)]
    assert [(r["model"], r["batch"]) for r in cpu["expected_bytes"]] == [
        ("tiny", 3), ("tiny", 2), ("qwen3-30b-a3b", 3), ("qwen3-30b-a3b", 2)]
    assert "compile" not in cpu and cpu["reason"] == "no GPU here"


def test_default_selection_is_the_library_prototypes_on_request():
    from tools import bench

    registry, warnings = bench.load_registry()
    assert warnings == []
    library = bench.select_variants(registry, None, prototypes=False)
    everything = bench.select_variants(registry, None, prototypes=True)
    assert library and all(not v.prototype for v in library)
    assert {v.name for v in everything} - {v.name for v in library} == {
        name for name, v in registry.items() if v.prototype}
    assert registry["proto:fused-layer"].prototype and registry["proto:warps-per-block"].prototype  # from prototypes/
    assert not registry["cupy:warp-decode"].prototype and not registry["cupy:auto"].prototype
    assert [v.name for v in bench.select_variants(registry, ["proto:fused-layer"], prototypes=False)] == [
        "proto:fused-layer"]  # a pattern still names a prototype


def test_bench_result_repr_says_what_happened():
    from tools import bench

    cpu = {"config": {"models": ["tiny"], "batches": [1], "variants": ["numba:warp-decode"], "routing": "uniform"},
           "results": [], "cpu": {"reason": "no CUDA driver (libcuda not found)",
                                  "simulator": {"status": "ok", "cases": [{"ok": True}]}, "reference": [{}]}}
    text = repr(bench.BenchResult(cpu))
    assert "NO TIMING TAKEN: no CUDA driver" in text and "simulator: ok (1/1 cases ok)" in text
    sample = json.loads((ROOT / "tests" / "data" / "bench_sample.json").read_text())
    text = repr(bench.BenchResult(sample))
    assert "qwen3-30b-a3b T=1: fastest cupy:warp-decode 20.0 µs" in text and "rows failed" in text


def test_why_no_gpu_names_what_is_missing(monkeypatch):
    class Runtime:
        @staticmethod
        def runtimeGetVersion() -> int:
            return 12090

    fake = type("cupy", (), {"cuda": type("cuda", (), {"runtime": Runtime})})
    monkeypatch.setattr(gpu, "_cuda_driver_version", lambda: None)
    assert gpu._why_no_device(fake, RuntimeError("cudaErrorInsufficientDriver")) == (
        "no CUDA driver (libcuda not found)")
    monkeypatch.setattr(gpu, "_cuda_driver_version", lambda: 12020)
    assert gpu._why_no_device(fake, RuntimeError("cudaErrorInsufficientDriver: ...")) == (
        "the CUDA driver (12020) is older than CuPy's CUDA runtime (12090)")
    assert gpu._why_no_device(fake, RuntimeError("cudaErrorNoDevice")) == "no GPU (the CUDA driver sees none)"


@pytest.mark.cpu_only
def test_gpu_available_reason_on_this_machine():
    gpu, why = harness.gpu_available()
    assert not gpu and why.startswith(("no CUDA driver", "no GPU", "the CUDA driver", "CuPy cannot"))


@pytest.mark.parametrize("module", ["tools.bench", "tools.harness"])
def test_unknown_options_exit_2(module, capsys):
    import importlib

    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main(["--bogus"])
    assert exc.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err.splitlines()[-1]


def test_steps_without_a_terminal_print_a_line_per_step():
    from tools.display import Steps

    stream = io.StringIO()
    with Steps(description="first", file=stream) as steps:
        steps.start("second")
        steps.log("a result")
    lines = stream.getvalue().splitlines()
    assert [line.split("] ", 1)[-1] for line in lines] == ["first", "second", "a result"]
    assert lines[0].startswith("[") and " s] " in lines[0]
    quiet = io.StringIO()
    with Steps(description="x", file=quiet, enabled=False) as steps:
        steps.start("y")
    assert quiet.getvalue() == ""


# -- sweep helpers ----------------------------------------------------------------------------------------
def test_sweep_grid_parsing():
    grid = sweep.parse_grid(["WARPS=4,8", "FUSE=true,false", "NAME=a"])
    assert grid == {"WARPS": [4, 8], "FUSE": [True, False], "NAME": ["a"]}
    assert len(sweep.points(grid)) == 4 and sweep.points({}) == [{}]
    for bad in (["WARPS"], ["=4"], ["WARPS="]):
        with pytest.raises(ValueError, match="KEY=v1,v2"):
            sweep.parse_grid(bad)


def test_sweep_compile_columns_report_what_runs():
    """Auto knobs are resolved for the sweep's dims, and a resolved 0 is compiled as 0: the tensor-core path's
    balanced down at T = 64 runs 24 warps under launch bounds alone (DB_MAX_REGS 0), so it must fit 85 registers."""
    from kernels.contract import Dims
    from kernels.variants import get_variant

    variant = get_variant("cupy:warp-decode-mma")
    columns = sweep.compile_columns(variant, {**variant.params, "DB_GROUPED": 0}, Dims(64, 2048, 768, 128, 8))
    assert columns["compile"] == "ok", columns
    assert columns["registers_per_kernel"]["moe_down_mma"] <= 65536 // (24 * 32)
    assert columns["spills"] == 0 and columns["stack_bytes"] == 0 and columns["occupancy"] > 0


def test_sweep_compile_columns_merge_batches():
    """A point's compile columns over the sweep's batches: the worst of each column, per kernel too (a batch may run
    other kernels); each batch's columns kept only where they differ; a failed batch names its T; the rendered table
    names the batches whose spills differ (a spill at T = 64 alone once hid behind the first batch's columns)."""
    from tools.display import text_of

    one = {"compile": "ok", "registers": 100, "registers_per_kernel": {"gate_up": 100, "down": 40}, "spills": 0,
           "stack_bytes": 0, "shared_bytes": 0, "occupancy": 0.5}
    other = {**one, "registers": 128, "registers_per_kernel": {"gate_up": 128, "down_grouped": 60}, "spills": 24,
             "stack_bytes": 16, "occupancy": 0.25}
    merged = sweep.merge_batches({"32": one, "64": other})
    assert merged["registers"] == 128
    assert merged["registers_per_kernel"] == {"gate_up": 128, "down": 40, "down_grouped": 60}
    assert (merged["spills"], merged["stack_bytes"], merged["occupancy"]) == (24, 16, 0.25)
    assert merged["compile_by_batch"] == {"32": one, "64": other}
    assert "compile_by_batch" not in sweep.merge_batches({"1": one, "8": dict(one)})
    assert sweep.merge_batches({"1": one, "8": {"compile": "ptxas error"}})["compile"] == "T=8: ptxas error"
    record = {"variant": "v", "model": "m", "routing": "uniform", "batches": [32, 64],
              "points": [{"params": {"X": 1}, **merged, "results": {}}]}
    assert "spills/stack by batch: T=32 0/0, T=64 24/16" in text_of(sweep.render(record), width=200)


def test_sweep_names_a_knob_the_rules_override():
    """A grid value the variant's rules resolve to another value (0 / -1, the auto values, aside) is recorded per batch
    and printed in red: that row does not measure what it names. The batched family's rules keep every explicit
    cap, 128 included (a GB_MAX_REGS=128 column once ran at 96)."""
    from types import SimpleNamespace

    from kernels.contract import Dims
    from kernels.variants import get_variant
    from tools.display import text_of

    def resolve(dims: Any, **params: Any) -> dict[str, Any]:  # a rule that replaces CAP 128
        return {**params, "CAP": 96 if params.get("CAP") == 128 else params.get("CAP"), "AUTO": 4}

    fake = SimpleNamespace(kernel_family=object(), resolve=resolve)
    dims = Dims(4, 4096, 1536, 128, 8)
    assert sweep.overridden(fake, {"CAP": 128, "AUTO": 0}, dims) == {"CAP": 96}
    assert sweep.overridden(fake, {"CAP": 120, "AUTO": -1}, dims) == {}
    assert sweep.overridden(fake, {"CAP": 128}, None) == {}
    assert sweep.overridden(get_variant("cupy:warp-decode-mma-fp8"), {"GB_MAX_REGS": 128, "DB_MAX_REGS": 128},
                            dims) == {}
    one = {"compile": "ok", "registers": 96, "registers_per_kernel": {"gate_up": 96}, "spills": 8, "stack_bytes": 0,
           "shared_bytes": 0, "occupancy": 0.3}
    merged = sweep.merge_batches({"4": {**one, "overridden": {"CAP": 96}}, "8": one})
    assert merged["overridden"] == {"4": {"CAP": 96}}
    record = {"variant": "v", "model": "m", "routing": "uniform", "batches": [4, 8],
              "points": [{"params": {"CAP": 128}, **merged, "results": {}}]}
    assert "at T=4 the rules run CAP=96: this row does not measure the value it names" in text_of(
        sweep.render(record), width=200)


def test_sweep_cli_errors():
    result = _run("-m", "tools.sweep", "no:such-variant", "--batch", "1")
    assert result.returncode == 2 and "unknown variant 'no:such-variant'" in result.stderr
    result = _run("-m", "tools.sweep", "x", "--grid", "WARPS")
    assert result.returncode == 2 and "KEY=v1,v2" in result.stderr
    result = _run("-m", "tools.sweep", "cupy:warp-decode", "--rounds", "0")
    assert result.returncode == 2 and "--rounds" in result.stderr and "int >= 1" in result.stderr
    with pytest.raises(ValueError, match="rounds must be an int >= 1, got 0"):
        sweep.sweep("cupy:warp-decode", rounds=0, progress=False)


def _timed(params: dict, run: int, **medians: float) -> dict:
    return {"params": params, "run": run,
            "results": {t[1:]: {"status": "ok", "median_us": us, "tbps": 1.0} for t, us in medians.items()}}


def test_sweep_repeat_spread():
    """The largest spread between the timed runs of one knob set at one batch: runs of other knob sets never mix, a
    failed run and a batch with one run do not count; the rendered table shows each row's run order and the line."""
    from tools.display import text_of

    entries = [_timed({"A": 1}, 1, t8=100.0, t16=200.0), _timed({"A": 2}, 2, t8=90.0, t16=150.0),
               _timed({"A": 1}, 3, t8=103.0, t16=202.0), _timed({"A": 2}, 4, t8=91.0),
               {"params": {"A": 2}, "run": 5, "results": {"8": {"status": "wrong", "median_us": 50.0}}}]
    spread = sweep.repeat_spread(entries, [8, 16])
    assert spread is not None and spread["params"] == {"A": 1} and spread["batch"] == 8 and spread["runs"] == 2
    assert spread["pct"] == pytest.approx(3.0)
    assert sweep.repeat_spread(entries[:2], [8, 16]) is None  # no knob set ran twice
    assert sweep.repeat_spread([_timed({}, 1, t1=10.0), _timed({}, 2, t1=11.0)], [1])["pct"] == pytest.approx(10.0)
    record = {"variant": "v", "model": "m", "routing": "uniform", "batches": [8, 16],
              "points": [{**e, "status": "ok"} for e in entries[:4]], "repeat_spread": spread}
    text = text_of(sweep.render(record), width=200)
    assert "runs differ by up to 3.0 % (A=1, T=8, 2 runs)" in text
    assert [line.split()[1] for line in text.splitlines() if line.strip()[:1].isdigit()][:4] == ["1", "2", "3", "4"]


def test_sweep_rounds_list_the_grid_in_turn(tmp_path):
    """--rounds N: the grid N times in turn, each row with its run order (without a GPU: compile columns only). In a
    subprocess: the sweep switches Numba to its simulator, a process-wide setting."""
    path = tmp_path / "sweep.json"
    result = _run("-m", "tools.sweep", "cupy:warp-decode", "--model", "tiny", "--batch", "1", "--grid", "DN_SLOTS=2,4",
                  "--rounds", "2", "--json", str(path))
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads(path.read_text())
    assert record["rounds"] == 2
    assert sorted((e["run"], e["params"]["DN_SLOTS"]) for e in record["points"]) == [(1, 2), (2, 4), (3, 2), (4, 4)]


# -- GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_rooflines_are_plausible():
    record = roofline.measure(repeats=3)
    assert 0.2 < record["read_tbps"] < 20 and 0.1 < record["d2d_memcpy_tbps"] < 20
    assert "copy16_error" not in record


@pytest.mark.gpu
def test_gpu_bench_tiny_every_variant_checks_and_times():
    from kernels.formats import FormatDimsError, get_format
    from kernels.shapes import PRESETS
    from kernels.variants import load_builtin
    from tools import bench

    result = bench.run("tiny", batch=[1, 3], repeats=3, progress=False, prototypes=True)
    rows = result.rows
    assert rows, "no variants registered"
    registry, tiny = load_builtin(), PRESETS["tiny"]
    for row in rows:
        fmt = get_format(getattr(registry.get(row["variant"]), "weight_format", "bf16"))
        try:  # tiled formats cannot store tiny's H = 136: their variants are unsupported there, the rest run
            fmt.check_dims(tiny.hidden, tiny.intermediate)
        except FormatDimsError as exc:
            assert (row["status"], row["error"]) == ("unsupported", f"{row['variant']}: {exc}"), row["variant"]
            continue
        assert row["status"] == "ok", (row["variant"], row["batch"], row.get("error"), row.get("check"))
        assert len(row["samples_us"]) == 3 and row["median_us"] > 0
        assert row["check"]["ok"] and row["check"]["all_written"]
        assert row["copies"] >= 2 and row["rotation"]["footprint_ok"]
    json.loads(result.to_json())


@pytest.mark.gpu
def test_gpu_bench_cli_log_is_readable_when_piped():
    """On a GPU, piped: a progress line from the start, a line per measured point, tables with every digit."""
    result = _run("-m", "tools.bench", "--model", "tiny", "--batch", "1,2", "--variants", "cupy:warp-decode",
                  "--repeats", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    err = result.stderr.splitlines()
    assert err[0].endswith("looking for a CUDA GPU")
    assert any("streaming-read roofline" in line for line in err)
    assert sum("tiny T=" in line and "cupy:warp-decode: " in line and "check ok" in line for line in err) == 2
    assert "…" not in result.stdout and "µs/layer" in result.stdout and "IQR" in result.stdout


@pytest.mark.gpu
def test_gpu_wrong_and_captured_fallback_variants_do_not_pass():
    from kernels.contract import is_capturing
    from kernels.variants import Variant
    from tools import bench

    registry, _ = bench.load_registry()
    real = registry.get("cupy:warp-decode")

    def build_nothing(dims, **params):
        return lambda x, w13, w2, topk_ids, topk_weights, out: None

    wrong = Variant(name="test:writes-nothing", backend="cupy", family="test", build=build_nothing)
    variants = [wrong]
    if real is not None:
        def build_fallback(dims, **params):
            launch = real.make(dims)

            def fallback(*args):
                if not is_capturing():  # correct when eager, nothing inside the graph
                    launch(*args)
            return fallback

        variants.append(Variant(name="test:captured-fallback", backend="cupy", family="test", build=build_fallback))
    result = bench.run("tiny", batch=[2], variants=variants, repeats=2, progress=False)
    by_name = {r["variant"]: r for r in result.rows}
    assert by_name["test:writes-nothing"]["status"] == "wrong"
    assert by_name["test:writes-nothing"]["samples_us"] == []  # never timed
    if real is not None:
        fallback = by_name["test:captured-fallback"]
        assert fallback["precheck"]["ok"] and fallback["status"] == "wrong"
        assert not fallback["check"]["all_written"]


# -- the harness's control flow on a NumPy-backed stand-in for CuPy (no GPU) --------------------------------
# The stand-in executes "launches" at once, or records them while its stream captures, and replays them when
# the "graph" is launched; events read the host clock. It checks the harness's plumbing (copies, views,
# pre-check, capture, replay, post-check, stages, JSON), not CUDA: the GPU tests above do that on the H200.
class _FakeStream:
    current = None

    def __init__(self, non_blocking=False):
        self.recording = None
        self.ptr = id(self)

    def run(self, fn):  # what a "kernel launch" does in the stand-in
        if self.recording is not None:
            self.recording.append(fn)
        else:
            fn()

    def begin_capture(self, mode=None):
        self.recording = []

    def end_capture(self):
        calls, self.recording = self.recording, None
        return _FakeGraph(calls)

    def is_capturing(self):
        return self.recording is not None

    def synchronize(self):
        pass

    def __enter__(self):
        self._previous, _FakeStream.current = _FakeStream.current, self
        return self

    def __exit__(self, *exc):
        _FakeStream.current = self._previous


class _FakeGraph:
    def __init__(self, calls):
        self.calls = calls

    def launch(self, stream=None):
        for call in self.calls:
            call()


def _fake_cupy():
    import time as _time
    import types

    cupy = types.ModuleType("cupy")
    for name in ("uint8", "uint16", "uint32", "uint64", "int64", "float32", "empty", "zeros", "empty_like", "asarray",
                 "random"):
        setattr(cupy, name, getattr(np, name))
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1,
        getDeviceProperties=lambda d: {"name": b"Fake H200", "multiProcessorCount": 4, "l2CacheSize": 1 << 16,
                                       "totalGlobalMem": 1 << 30, "major": 9, "minor": 0, "memoryBusWidth": 64},
        deviceGetAttribute=lambda attr, d: 1_000_000, cudaDevAttrClockRate=13, cudaDevAttrMemoryClockRate=36,
        cudaDevAttrGlobalMemoryBusWidth=37, memGetInfo=lambda: (8 << 30, 8 << 30), driverGetVersion=lambda: 13000,
        runtimeGetVersion=lambda: 13000, memcpyDeviceToDevice=3, memcpyAsync=lambda *a: None,
    )

    class Event:
        def record(self, stream=None):
            self.t = _time.perf_counter()

        def synchronize(self):
            pass

    default = _FakeStream()
    cupy.cuda = types.SimpleNamespace(
        runtime=runtime, Stream=_FakeStream, Event=Event,
        Device=lambda *a: types.SimpleNamespace(id=0, synchronize=lambda: None),
        get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3,
        get_current_stream=lambda: _FakeStream.current or default,
    )
    cupy.get_default_memory_pool = lambda: types.SimpleNamespace(total_bytes=lambda: 0, used_bytes=lambda: 0,
                                                                 free_all_blocks=lambda: None)
    return cupy


def _reference_variant(name, capture_fallback=False, wrong=False, stages=False, weight_format="bf16"):
    from kernels.reference import moe_decode
    from kernels.variants import Variant

    def build(dims, **params):
        import cupy

        def compute(x, w13, w2, ids, weights, out):
            result = moe_decode(x, w13, w2, ids, weights, mode="warp_decode", weight_format=weight_format)
            out[...] = (result.astype(np.float32) * (1.5 if wrong else 1.0)).astype(BF16)

        def launch(*args):
            stream = cupy.cuda.get_current_stream()
            if capture_fallback and stream.is_capturing():
                return  # "a captured fallback": correct when eager, nothing in the graph
            stream.run(lambda: compute(*args))

        from kernels.family import Launch

        both = (lambda *args: [("all", lambda: launch(*args)), ("again", lambda: launch(*args))]) if stages else None
        return Launch(run=launch, stages=both)

    return Variant(name=name, backend="cupy", family="warp-decode", build=build, weight_format=weight_format)


def test_stage_costs_in_the_chain_leave_one_stage_out():
    """A stage's cost in the layer's chain is the whole layer's time minus the layer's without it, each timed as the
    layer is (here a stand-in timer: each stage's own time plus 3 µs per boundary between two stages); a launch of
    one stage gets its time alone only."""
    ran: list[str] = []
    cost = {"lists": 2.0, "gate_up": 100.0, "down": 50.0}
    stages = [(name, lambda name=name: ran.append(name)) for name in cost]

    def fake_time(stream, fns, repeats):
        ran.clear()
        fns[0]()
        return [sum(cost[n] for n in ran) + 3.0 * (len(ran) - 1)] * repeats, "graph", None

    bench = object.__new__(harness.Workbench)  # no GPU, no weights: only the timing plumbing
    bench._time, bench._last = fake_time, []
    out = bench._time_stages(None, type("L", (), {"stages": lambda self, *a: stages})(), [()], 3)
    assert [(s["name"], s["median_us"], s["without_us"], s["in_chain_us"]) for s in out] == [
        ("lists", 2.0, 153.0, 5.0), ("gate_up", 100.0, 55.0, 103.0), ("down", 50.0, 105.0, 53.0)]
    assert {s["layer_us"] for s in out} == {158.0}
    alone = bench._time_stages(None, type("L", (), {"stages": lambda self, *a: stages[1:2]})(), [()], 3)
    assert alone[0]["median_us"] == 100.0 and "in_chain_us" not in alone[0]


def test_harness_flow_on_a_numpy_stand_in(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(harness, "TARGET_SAMPLE_US", 1.0)  # the stand-in's "kernels" are slow NumPy
    from kernels.shapes import get_shape

    shape = get_shape("tiny")
    work = harness.Workbench(shape, 5, "uniform", seed=1)
    assert work.copies >= 2 and work.info["copies_needed"] == work.copies
    assert work.pool_experts == work.copies * shape.experts  # full copies: fresh draws may touch any expert
    assert work.weights(work.copies - 1)[0].shape == (shape.experts, 2 * shape.intermediate, shape.hidden)
    from kernels.routing import make_routing

    base = make_routing(5, shape.experts, shape.top_k, "uniform", 1)  # draw 0 of the check copy: the checks' routing
    np.testing.assert_array_equal(work.draw(0)[0][work.check_copy], base[0])
    draws = [work.draw(s)[0] for s in range(4)]
    assert len({d.tobytes() for sample in draws for d in sample}) == 4 * work.copies  # every (sample, copy) fresh

    good = work.measure(_reference_variant("fake:good", stages=True), repeats=4)
    assert good["status"] == "ok", good["error"]
    assert good["timing_mode"] == "graph" and len(good["samples_us"]) == 4 and good["median_us"] > 0
    assert good["check"]["ok"] and good["check"]["max_ulp"] == 0 and good["check"]["copy"] == work.copies - 1
    assert good["error_vs_fp64"]["rel_l2"] < 5e-3
    assert [s["name"] for s in good["stages"]] == ["all", "again"]
    assert all(s["in_chain_us"] == pytest.approx(s["layer_us"] - s["without_us"]) for s in good["stages"])
    assert good["tbps"] == pytest.approx(good["bytes"]["weights"] / good["median_us"] / 1e6)
    assert good["bytes"]["routing_draws"] == 4 * work.copies  # the bytes divide by the mean over the timed draws
    mean = np.mean([np.unique(d).size for s in range(4) for d in work.draw(s)[0]])
    assert good["bytes"]["unique_experts"] == pytest.approx(mean)
    assert good["samples_unique_experts"] == pytest.approx(
        [np.mean([np.unique(d).size for d in work.draw(s)[0]]) for s in range(4)])
    np.testing.assert_array_equal(work.ids_buffers, work.draw(0)[0])  # the checks ran on draw 0 again

    fallback = work.measure(_reference_variant("fake:fallback", capture_fallback=True), repeats=2)
    assert fallback["precheck"]["ok"] and fallback["status"] == "wrong"
    assert not fallback["check"]["all_written"]

    wrong = work.measure(_reference_variant("fake:wrong", wrong=True), repeats=2)
    assert wrong["status"] == "wrong" and wrong["samples_us"] == []  # never timed

    def broken(dims, **params):
        raise RuntimeError("does not compile")

    from kernels.variants import Variant

    error = work.measure(Variant(name="fake:broken", backend="cupy", family="x", build=broken))
    assert error["status"] == "error" and "does not compile" in error["error"]
    work.free()

    from tools import report

    data = {"environment": harness.environment(True), "rooflines": {"read_tbps": 1.0},
            "results": [good, fallback, wrong, error]}
    json.dumps(data)
    assert data["environment"]["gpu"]["sm_clock_mhz"] == 1000.0
    assert "fake:fallback" in report.markdown(data)


def test_each_timed_sample_runs_on_its_own_routing_draws(monkeypatch):
    """Every layer copy reads its own routing buffers, refilled with sample i's draws before sample i: the kernels
    see every (sample, copy) draw, and every variant on a workbench sees the same draws."""
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(harness, "TARGET_SAMPLE_US", 1.0)
    from kernels.family import Launch
    from kernels.shapes import get_shape
    from kernels.variants import Variant

    seen: dict[str, set[bytes]] = {}

    def recorder(name):
        def build(dims, **params):
            import cupy

            def launch(x, w13, w2, ids, weights, out):
                def run():
                    seen.setdefault(name, set()).add(ids.tobytes())
                    out[...] = 0
                cupy.cuda.get_current_stream().run(run)
            return Launch(run=launch)
        return Variant(name=name, backend="cupy", family="x", build=build, reference_mode="warp_decode")

    work = harness.Workbench(get_shape("tiny"), 3, "uniform", seed=4)
    for name in ("a", "b"):
        work.measure(recorder(name), repeats=3)  # "wrong" (zeros) is fine: only the routing it saw matters
    # a wrong variant is never timed: a correct one shows what the timed samples read
    assert seen["a"] == seen["b"] == {d.tobytes() for d in work.draw(0)[0]}  # untimed: draw 0 of every copy
    timed: set[bytes] = set()

    def spy(name):
        variant = _reference_variant(name)
        inner = variant.build

        def build(dims, **params):
            launch = inner(dims, **params)

            def run(x, w13, w2, ids, weights, out):
                import cupy

                cupy.cuda.get_current_stream().run(lambda: timed.add(ids.tobytes()))
                launch(x, w13, w2, ids, weights, out)
            return Launch(run=run)
        return Variant(name=name, backend="cupy", family="x", build=build, reference_mode="warp_decode")

    row = work.measure(spy("fake:spy"), repeats=3)
    assert row["status"] == "ok", row["error"]
    assert timed == {d.tobytes() for s in range(3) for d in work.draw(s)[0]}
    work.free()


def test_harness_times_a_scaled_format_on_its_own_copies(monkeypatch):
    """An fp8-block128 variant gets fp8 copies of the same experts (quantized once from the bf16 pool), enough of
    them to rotate the FP8 bytes past 3x L2, its bytes counted in FP8, and its check and fp64 error on those weights."""
    from kernels.formats import FP8_BLOCK128, Quantized, quantize_weights
    from kernels.shapes import get_shape

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(harness, "TARGET_SAMPLE_US", 1.0)
    shape = get_shape("tiny")
    plain = harness.Workbench(shape, 3, "uniform", seed=2)
    work = harness.Workbench(shape, 3, "uniform", seed=2, weight_formats=(FP8_BLOCK128.name,))
    assert work.weight_formats == ("bf16", "fp8-block128") and work.info["weight_formats"] == list(work.weight_formats)
    fp8_expert = FP8_BLOCK128.expert_bytes(shape.hidden, shape.intermediate)
    fp8_bytes = int(shape.expected_unique_experts(3) * fp8_expert)  # copies are sized by the expected draw
    assert work.info["copies_needed"] == harness.copies_needed(fp8_bytes, work.l2_bytes) >= plain.copies
    assert work.info["footprint_ok"] and work.info["rotated_weight_bytes"] == pytest.approx(work.copies * fp8_bytes, 1)
    last = work.copies - 1
    q13, q2 = work.weights(last, FP8_BLOCK128.name)
    assert isinstance(q13, Quantized) and q13.values.shape == (shape.experts, 2 * shape.intermediate, shape.hidden)
    want13, want2 = quantize_weights(*work.weights(last), FP8_BLOCK128.name)  # the same experts, quantized
    np.testing.assert_array_equal(q13.values.view(np.uint8), want13.values.view(np.uint8))
    np.testing.assert_array_equal(q2.scales, want2.scales)
    with pytest.raises(ValueError, match="weight_format 'mxfp4' has no pool here; this workbench holds bf16, fp8"):
        work.weights(0, "mxfp4")

    row = work.measure(_reference_variant("fake:fp8-weights", weight_format=FP8_BLOCK128.name), repeats=2)
    assert row["status"] == "ok", row["error"]
    assert row["check"]["max_ulp"] == 0 and row["bytes"]["weight_format"] == FP8_BLOCK128.name
    assert row["bytes"]["weights"] == pytest.approx(row["bytes"]["unique_experts"] * fp8_expert)
    assert 1e-3 < row["error_vs_fp64"]["rel_l2"] < 1e-2  # fp64 on the same dequantized weights: the kernel's error
    blind = work.measure(_reference_variant("fake:reads-bf16"), repeats=2)  # a bf16 variant on the same workbench
    assert blind["status"] == "ok" and blind["bytes"]["weight_format"] == "bf16"
    work.free()


@pytest.mark.cpu_only
def test_roofline_flow_on_a_numpy_stand_in(monkeypatch):
    fake = _fake_cupy()

    class RawModule:
        def __init__(self, code, options=(), name_expressions=None):
            assert "stream_read" in code

        def compile(self):
            pass

        def get_function(self, name):
            def kernel(grid, block, args):
                if name == "copy16":
                    args[1][...] = args[0]
            return kernel

    fake.RawModule = RawModule
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(roofline, "_ptr", lambda arr: arr.ctypes.data)
    from kernels.compile import clear_memory_cache

    record = roofline.measure(repeats=2, read_bytes=1 << 20, copy_bytes=1 << 20)
    clear_memory_cache()
    assert record["datasheet_tbps"] == 4.8 and record["grid"] == [4 * 8, 512]
    assert len(record["read_samples_us"]) == 2 and record["read_tbps"] > 0
    assert record["d2d_memcpy_tbps"] > 0 and record["copy16_tbps"] > 0 and "copy16_error" not in record


def test_window_read_samples_cycle_windows_and_split_parts(monkeypatch):
    """Each of the graph's reads covers the next window of the source (cycling), split into the given parts."""
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    seen = []

    def read(grid, block, args):
        view, n16, _ = args
        seen.append((view.ctypes.data - source.ctypes.data, int(n16) * 16, grid, block))

    source = np.zeros(3 * 64 // 4 + 5, np.uint32)  # 3 whole 64-byte windows (and a tail never read)
    samples = roofline.window_read_samples(read, 8, 32, source, None, sys.modules["cupy"].cuda.Stream(), 64,
                                           parts=[(0, 48), (48, 16)], layers=4, repeats=3)
    assert len(samples) == 3 and all(s >= 0 for s in samples)
    per_layer = [(0, 48), (48, 16), (64, 48), (112, 16), (128, 48), (176, 16), (0, 48), (48, 16)]  # 4th: window 0
    assert [(offset, size) for offset, size, _, _ in seen[:8]] == per_layer  # the eager warm-up
    assert seen[8:] == seen[:8] * (len(seen) // 8 - 1) and {(g, b) for _, _, g, b in seen} == {((8,), (32,))}


@pytest.mark.cpu_only
def test_bench_run_flow_on_a_numpy_stand_in(monkeypatch):
    """bench.run end to end (rooflines, workbenches, variants, crossover, result object) on the stand-in."""
    from tools import bench

    test_roofline_flow_on_a_numpy_stand_in(monkeypatch)  # installs the stand-in with RawModule
    monkeypatch.setattr(bench, "load_registry", lambda: ({}, []))
    monkeypatch.setattr(harness, "TARGET_SAMPLE_US", 1.0)
    small = roofline.measure
    monkeypatch.setattr(roofline, "measure", lambda: small(repeats=2, read_bytes=1 << 20, copy_bytes=1 << 20))
    fast = _reference_variant("fake:warp")
    base = _reference_variant("fake:base")
    base = type(base)(**{**base.__dict__, "baseline": True, "family": "expert-centric",
                         "reference_mode": "warp_decode"})
    checkpoints = []
    original = bench.BenchResult.to_json

    def counting(self, path=None):
        if path is not None:
            checkpoints.append(len(self.data["results"]))
            return original(self)
        return original(self)

    monkeypatch.setattr(bench.BenchResult, "to_json", counting)
    result = bench.run("tiny", batch=[1, 2], variants=[fast, base], repeats=2, progress=False, json_path="x.json")
    assert checkpoints == [2, 4, 4]  # rewritten after every batch, and at the end
    assert result.data["complete"] is True
    assert [r["status"] for r in result.rows] == ["ok"] * 4
    assert result.data["rooflines"]["read_tbps"] > 0
    assert result.data["crossover"]["tiny"]["baseline"] == "fake:base"
    assert json.loads(result.to_json())["environment"]["gpu"]["name"] == "Fake H200"
    assert "fake:warp" in result._repr_html_()
