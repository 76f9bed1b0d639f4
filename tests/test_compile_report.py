"""tools.compile_report: the offline compile report (CPU only: NVRTC for sm_90, no GPU)."""

from __future__ import annotations

import json

import pytest

from tools import compile_report as offline


@pytest.mark.parametrize(
    ("registers", "threads", "shared", "warps", "limiter"),
    [
        (40, 128, 0, 48, "registers"),  # 40 regs x 32 = 1280 per warp -> 51 warps -> 12 blocks of 4
        (128, 128, 0, 16, "registers"),
        (32, 1024, 0, 64, "warps"),
        (255, 32, 0, 8, "registers"),  # 255 -> 8192 per warp (256 granularity) -> 8 warps
        (16, 32, 0, 32, "blocks"),  # 32 blocks of one warp
        (16, 128, 100 * 1024, 8, "shared"),  # 2 blocks of (100 KB + 1 KB reserved) in 228 KB
        (0, 64, 0, 64, "warps"),
        (64, 96, 0, 30, "registers"),  # 3-warp blocks: 32 warps by registers -> 10 blocks
    ],
)
def test_occupancy_arithmetic(registers: int, threads: int, shared: int, warps: int, limiter: str) -> None:
    occ = offline.occupancy(registers, threads, shared)
    assert occ.warps_per_sm == warps
    assert occ.limiter == limiter
    assert float(occ) == pytest.approx(warps / 64)


def test_occupancy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        offline.occupancy(40, 0)
    with pytest.raises(ValueError):
        offline.occupancy(300, 128)


def test_warp_decode_cupy_compiles_without_spills() -> None:
    """Defaults and every parameter set the source lists (the auto choices of all presets): no spill, no stack."""
    from kernels import warp_decode_cupy as wdc

    rows = offline.collect(["warp_decode_cupy"])
    param_sets = [wdc.SOURCE.params(**v) for v in ({}, *wdc.SOURCE.variants)]
    # one row per kernel and its own knobs: a parameter set that changes only the down's knobs lists no new gate_up
    expected = {(kernel, json.dumps(offline.kernel_params(wdc.SOURCE, kernel, params), sort_keys=True))
                for params in param_sets for kernel in (wdc.GATE_UP, wdc.DOWN)}
    assert len(rows) == len(expected) and {(r.kernel, json.dumps(r.params, sort_keys=True)) for r in rows} == expected
    for row in rows:
        assert not row.error, row.error
        assert row.spills == 0 and row.stack_bytes == 0, (row.kernel, row.params, row.spills, row.stack_bytes)
        assert row.shared_bytes == 0
        warps_knob = "GU_WARPS" if row.kernel == wdc.GATE_UP else "DN_WARPS"
        assert not any(k.startswith("DN_" if row.kernel == wdc.GATE_UP else "GU_") for k in row.params), row
        assert row.threads_per_block == 32 * {**wdc.DEFAULTS, **row.params}[warps_knob]
        assert row.occupancy is not None
    defaults = {row.kernel: row for row in rows if row.is_default}
    # the H200 sweep's defaults: gate_up 16 loads per lane at 70 registers (28 warps / SM); down 4 x 16 B
    # loads at <= 64 registers (32 warps / SM)
    assert defaults["moe_gate_up_3d_batched"].warps_per_sm >= 28
    assert defaults["moe_down_3d_batched"].warps_per_sm >= 32


def test_render_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    from tools.display import FitTable, text_of

    rows = offline.collect(["warp_decode_cupy"], defaults_only=True)
    table = offline.render(rows)
    assert isinstance(table, FitTable) and len(table.rows) == len(rows) == 2
    for width in (60, 100, 200):  # every kernel name and register count survives any width
        text = text_of(table, width)
        assert "…" not in text
        assert all(row.kernel[:8] in text and str(row.registers) in text for row in rows)
    assert offline.main(["--json", "--source", "warp_decode_cupy", "--defaults-only", "--no-numba"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {line["kernel"] for line in lines} == {"moe_gate_up_3d_batched", "moe_down_3d_batched"}
    assert all(line["spills"] == 0 for line in lines)


def test_each_row_shows_only_its_kernels_knobs() -> None:
    """A knob with the prefix a source declares for one kernel belongs to that kernel (the strict gate_up is not
    labelled with DN_SLOTS); knobs of no declared prefix (PDL) go with every kernel; a kernel, or a source, without a
    declared prefix keeps them all."""
    from kernels import warp_decode_cupy as wdc
    from kernels.compile import CudaSource

    params = wdc.SOURCE.params(DN_SLOTS=8, DN_WARPS=1, GU_UNROLL=4)
    gate_up = offline.kernel_params(wdc.SOURCE, wdc.GATE_UP, params)
    down = offline.kernel_params(wdc.SOURCE, wdc.DOWN, params)
    assert gate_up == {k: v for k, v in params.items() if not k.startswith("DN_")} and gate_up["GU_UNROLL"] == 4
    assert down == {k: v for k, v in params.items() if not k.startswith("GU_")} and down["DN_SLOTS"] == 8
    assert "PDL" in gate_up and "PDL" in down
    source = CudaSource("s", "", ("a", "b", "lists"), {"A_WARPS": 2, "B_WARPS": 4, "LIST_THREADS": 64},
                        knob_prefixes={"a": "A_", "b": "B_"})
    assert offline.kernel_params(source, "a", source.defaults) == {"A_WARPS": 2, "LIST_THREADS": 64}
    assert offline.kernel_params(source, "lists", source.defaults) == source.defaults
    undeclared = CudaSource("s", "", ("a", "b"), dict(source.defaults), warps_knobs={"a": "A_WARPS", "b": "B_WARPS"})
    assert offline.kernel_params(undeclared, "a", undeclared.defaults) == undeclared.defaults


def test_strict_variant_rows_label_each_kernel_with_its_own_knobs() -> None:
    """The bench's compile summary of the strict path at qwen3-30b T = 1: the gate_up row names no down knob."""
    from kernels.contract import Dims
    from kernels.variants import load_builtin

    rows = offline.variant_rows(load_builtin()["cupy:warp-decode"], Dims(1, 2048, 768, 128, 8))
    by_kernel = {row.kernel: row for row in rows}
    assert not any(k.startswith("DN_") for k in by_kernel["moe_gate_up_3d_batched"].params)
    assert by_kernel["moe_down_3d_batched"].params["DN_SLOTS"] == 8  # the auto rule's choice there
    assert "DN_" not in offline._fmt_params(by_kernel["moe_gate_up_3d_batched"].params,
                                            load_builtin()["cupy:warp-decode"].source)


def test_accepted_spill_is_marked_with_its_reason() -> None:
    """A spill the source accepts (declared beside the kernel: CudaSource.accepted_spills) carries its reason and is
    marked in the table, the reason under it; a larger spill of the same kernel, or any other kernel's, is not."""
    from kernels import warp_decode_fp8 as wdf
    from kernels.compile import KernelResources
    from tools.display import text_of

    limit, why = wdf.SOURCE.accepted_spills[wdf.DOWN]
    assert why and wdf.ACCEPTED_SPILL_BYTES[wdf.DOWN] == limit
    assert offline.accepted_spill(wdf.SOURCE, KernelResources(wdf.DOWN, 128, 0, 40, 44, 60)) == why
    assert offline.accepted_spill(wdf.SOURCE, KernelResources(wdf.DOWN, 128, 0, 0, limit + 4, 0)) == ""
    assert offline.accepted_spill(wdf.SOURCE, KernelResources(wdf.GATE_UP, 128, 0, 0, 8, 8)) == ""
    assert offline.accepted_spill(wdf.SOURCE, KernelResources(wdf.DOWN, 80, 0, 0, 0, 0)) == ""
    rows = [offline.Row("warp_decode_fp8", wdf.DOWN, {"DN_SLOTS": 8}, 128, 0, 40, 44, 60, 128, 16, 0.25,
                        "registers", accepted_spill=why),
            offline.Row("warp_decode_fp8", wdf.GATE_UP, {}, 200, 0, 16, 8, 8, 128, 8, 0.125, "registers")]
    text = text_of(offline.render(rows), 200)
    assert "44/60†" in text and "8/8" in text and "8/8†" not in text
    assert f"† accepted spill, {wdf.DOWN} (warp_decode_fp8): {why}" in " ".join(text.split())


def test_fp8_down_spill_at_its_auto_rule_is_accepted() -> None:
    """At qwen3-30b T = 1 the strict FP8 down runs 8 slots under its 128-register cap: whatever this NVRTC spills
    there is within the declared bound and so marked accepted; nothing else spills."""
    from kernels.contract import Dims
    from kernels.variants import load_builtin

    rows = offline.variant_rows(load_builtin()["cupy:warp-decode-fp8"], Dims(1, 2048, 768, 128, 8))
    assert len(rows) == 2 and not any(row.error for row in rows)
    for row in rows:
        assert bool(row.accepted_spill) == bool(row.spills or row.stack_bytes), row
        assert row.kernel == "moe_down_fp8" or not row.accepted_spill


def test_unknown_block_size_is_explained_under_the_table() -> None:
    """A kernel whose block size no knob gives (the roofline's, set where it is launched) shows ``?``, and the
    caption says what ``?`` means; a table without one has no such line."""
    from tools.display import text_of

    rows = [row for row in offline.collect(["roofline"]) if not row.error]
    assert rows and all(row.threads_per_block is None and row.occupancy is None for row in rows)
    text = " ".join(text_of(offline.render(rows), 200).split())
    assert "? the report cannot tell this kernel's threads per block" in text
    assert "occupancy are not computed offline" in text
    plain = offline.collect(["warp_decode_cupy"], defaults_only=True)
    assert "cannot tell" not in text_of(offline.render(plain), 200)


def test_compile_errors_become_rows() -> None:
    from kernels.compile import SOURCES, CudaSource, register_source

    register_source(CudaSource("broken_for_test", "this is not CUDA", ("k",), {"WARPS": 4}))
    try:
        rows = offline.collect(["broken_for_test"])
        assert len(rows) == 1 and rows[0].error
        offline.render(rows)
    finally:
        SOURCES.pop("broken_for_test", None)
    with pytest.raises(ValueError, match="unknown CUDA source"):
        offline.collect(["no_such_source"])


def test_numba_rows_come_from_families_without_cuda_c() -> None:
    """Families without CUDA C report through their ``offline_reports``; nothing else is guessed."""
    from kernels.compile import KernelResources
    from kernels.family import KernelFamily
    from kernels.variants import REGISTRY, register

    class Report(KernelResources):
        params = {"warps": 8}
        is_default = True
        threads_per_block = 256

    family = KernelFamily("fake-numba", knobs={"warps": 8},
                          offline_reports=lambda: [Report("moe_down_3d_batched", 56, 0, 0, 0, 0)])
    register(family.variant("numba:fake-for-test", backend="numba"))
    try:
        rows = [row for row in offline.numba_rows() if row.kernel == "moe_down_3d_batched" and row.registers == 56]
    finally:
        REGISTRY.pop("numba:fake-for-test")
    assert len(rows) == 1 and rows[0].source == "numba"
    assert rows[0].threads_per_block == 256 and rows[0].warps_per_sm == 32


def test_threads_per_block_conventions() -> None:
    from kernels.compile import CudaSource

    plain = CudaSource("s", "", ("a",), {"WARPS": 8})
    assert offline.threads_per_block(plain, "a", {"WARPS": 8}) == 256
    prefixed = CudaSource("s", "", ("a",), {"A_WARPS": 2})
    assert offline.threads_per_block(prefixed, "a", {"A_WARPS": 2}) == 64
    assert offline.threads_per_block(prefixed, "a", {"A_WARPS": 2, "B_WARPS": 4}) is None


def test_offline_report_recompiles_when_the_compute_cache_swallowed_ptxas_report(monkeypatch) -> None:
    """NVRTC may serve a text from the CUDA compute cache without running ptxas (no -v report): the report is
    then taken from a compile of the same code with a unique trailing comment (a new cache key)."""
    import kernels.compile as compile_mod
    import kernels.warp_decode_cupy as wdc

    real = compile_mod.offline_compile
    texts: list[str] = []

    def cached_first(text: str, arch: str = "sm_90", name: str = "kernel.cu") -> tuple[bytes, str]:
        texts.append(text)
        cubin, log = real(text, arch, name)
        return (cubin, "") if len(texts) == 1 else (cubin, log)

    monkeypatch.setattr(compile_mod, "offline_compile", cached_first)
    monkeypatch.setattr(compile_mod, "_REPORTS", {})  # as in a fresh process: another test may have compiled it
    monkeypatch.delenv(compile_mod.REPORT_CACHE_ENV, raising=False)  # and without the run's shared reports
    reports = compile_mod.offline_report(wdc.SOURCE, **wdc.DEFAULTS)
    assert {r.kernel for r in reports} == {wdc.GATE_UP, wdc.DOWN} and len(texts) == 2
    assert texts[1].startswith(texts[0]) and "// offline report" in texts[1][len(texts[0]):]
    assert all(not r.kernel.startswith("offline_report_") for r in reports)  # the retry's empty kernel is dropped


def test_offline_report_compiles_a_text_once_per_process(monkeypatch) -> None:
    """A text already reported is not compiled again (the suite and the sweep ask for the same texts); an edited
    text, another knob value or a compile error is compiled (again)."""
    import kernels.compile as compile_mod

    real, compiled = compile_mod.offline_compile, []

    def counting(text: str, arch: str = "sm_90", name: str = "kernel.cu") -> tuple[bytes, str]:
        compiled.append(text)
        return real(text, arch, name)

    monkeypatch.setattr(compile_mod, "offline_compile", counting)
    monkeypatch.setattr(compile_mod, "_REPORTS", {})
    monkeypatch.delenv(compile_mod.REPORT_CACHE_ENV, raising=False)
    source = compile_mod.CudaSource("cache_test", 'extern "C" __global__ void k(float* x) { x[0] = N; }', ("k",),
                                    {"N": 1})
    first = compile_mod.offline_report(source)
    assert compile_mod.offline_report(source) == first and len(compiled) == 1
    compile_mod.offline_report(source, N=2)
    source.code = source.code.replace("x[0]", "x[1]")
    compile_mod.offline_report(source)
    assert len(compiled) == 3 and len(set(compiled)) == 3
    source.code = "not CUDA"
    for _ in range(2):
        with pytest.raises(compile_mod.OfflineCompileError):
            compile_mod.offline_report(source)
    assert len(compiled) == 5


def test_offline_report_compiles_a_text_once_per_shared_folder(monkeypatch, tmp_path) -> None:
    """With $WD_OFFLINE_REPORT_CACHE set, a process that has not compiled a text reads the report another process
    left in that folder (the test suite's workers and the tools it starts share one); another text, or the same text
    for another arch, is compiled; a compile error leaves nothing behind."""
    import kernels.compile as compile_mod

    real, compiled = compile_mod.offline_compile, []

    def counting(text: str, arch: str = "sm_90", name: str = "kernel.cu") -> tuple[bytes, str]:
        compiled.append((text, arch))
        return real(text, arch, name)

    monkeypatch.setattr(compile_mod, "offline_compile", counting)
    monkeypatch.setattr(compile_mod, "_REPORTS", {})
    monkeypatch.setenv(compile_mod.REPORT_CACHE_ENV, str(tmp_path / "reports"))
    source = compile_mod.CudaSource("shared_test", 'extern "C" __global__ void k(float* x) { x[0] = N; }', ("k",),
                                    {"N": 1})
    first = compile_mod.offline_report(source)
    monkeypatch.setattr(compile_mod, "_REPORTS", {})  # another process: nothing in memory
    assert compile_mod.offline_report(source) == first and len(compiled) == 1
    compile_mod.offline_report(source, N=2)
    compile_mod.offline_report(source, arch="sm_80")
    assert len(compiled) == 3 and len(set(compiled)) == 3
    assert len(list((tmp_path / "reports").glob("*.json"))) == 3
    source.code = "not CUDA"
    with pytest.raises(compile_mod.OfflineCompileError):
        compile_mod.offline_report(source)
    assert len(list((tmp_path / "reports").glob("*.json"))) == 3


def test_variant_rows_report_what_a_variant_runs() -> None:
    """One row per kernel with the knobs the variant resolves for these dims; a composing variant has none."""
    from kernels.contract import Dims
    from kernels.variants import load_builtin

    registry = load_builtin()
    dims = Dims(1, 2048, 768, 128, 8)
    rows = offline.variant_rows(registry["cupy:warp-decode"], dims)
    assert {row.kernel for row in rows} == {"moe_gate_up_3d_batched", "moe_down_3d_batched"}
    assert all(row.variant == "cupy:warp-decode" and not row.error and row.registers > 0 for row in rows)
    resolved = registry["cupy:warp-decode"].resolve(dims)
    assert all(row.params[key] == value for row in rows for key, value in resolved.items() if key in row.params)
    assert offline.variant_rows(registry["cupy:auto"], dims) == []


@pytest.mark.parametrize("argv, message", [(["--bogus"], "unrecognized arguments: --bogus"),
                                           (["--source", "nope"], "unknown CUDA source(s) 'nope'")])
def test_cli_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        offline.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
