"""Auto-dispatch (kernels/dispatch.py) and the table tool (tools/dispatch_table.py).

CPU: slugs, policies, the heuristic and its boundaries (T*K vs E/8 and 2E, paths that cannot run the dims),
table lookup per policy (nearest lower point, a point where expert-centric is fastest, old choice-only points,
missing candidates, bad statuses, unknown shape / GPU -> heuristic), table validation, the tool's winner /
point / merge logic and ``--from-bench`` over several runs, the committed H200 table (valid, its choices the
fastest candidate of each policy at every point), a table naming a variant since removed (the mixed path: history,
never picked, named by the tool), input / policy / workspace errors before any device call,
the variants' registration, and the bench harness checking a launch against its own ``reference_mode`` /
``quant`` (on the NumPy stand-in for CuPy of tests/test_bench.py).
GPU: moe_decode equals the chosen path bitwise and matches the chosen path's reference mode, per policy
(expert-centric chosen by a fabricated table and by the heuristic); bitwise repeatable over 3 runs; capture of
moe_decode and of the auto variants (a decision that synced with the host would break the capture); replay on
new routing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels import batched, dispatch
from kernels.batched import fma, lists, mma
from kernels.contract import BF16, Dims
from kernels.formats import get_format
from kernels.problem import make_problem
from kernels.shapes import PRESETS
from kernels.variants import get_variant
from tests.warp_checks import FakeCupyArray, _assert_matches, _poisoned_out, _references, _seed
from tools import dispatch_table

QWEN30 = PRESETS["qwen3-30b-a3b"]
TINY = PRESETS["tiny"]
S, B, M, EC = dispatch.STRICT, dispatch.BATCHED, dispatch.MMA, dispatch.EXPERT_CENTRIC
X = "cupy:warp-decode-mixed"  # a candidate until the batched families: old tables and runs still name it (history)
P, G = dispatch.MMA_PAIRS, dispatch.MMA_GROUPED
TM, TP, TG = dispatch.FP8_T16_MMA, dispatch.FP8_T16_MMA_PAIRS, dispatch.FP8_T16_MMA_GROUPED  # fp8-block128-t16's


def _dims(shape: Any, tokens: int) -> Dims:
    return Dims(tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k)


def _record(median: float | None, status: str = "ok") -> dict[str, Any]:
    return {"median_us": median, "status": status, "tbps": None, "bytes": {"unique_experts": 8}}


def _write_points(directory: Path, gpu: str, shape: Any, points: dict[int, dict[str, Any]]) -> Path:
    """A table file of raw points (any format) for ``shape``."""
    table = {"schema": dispatch.SCHEMA, "gpu": gpu, "slug": dispatch.gpu_slug(gpu), "date": "2026-11-30",
             "entries": {dispatch.shape_key(_dims(shape, 1)): {"model": shape.name, "points": {
                 str(t): p for t, p in points.items()}}}}
    path = directory / f"{dispatch.gpu_slug(gpu)}.json"
    path.write_text(json.dumps(table))
    dispatch.load_table.cache_clear()
    return path


def _write_table(directory: Path, gpu: str, shape: Any, medians: dict[int, dict[str, float]]) -> Path:
    """A table file as the tool writes it: per T, each candidate's median (all status "ok")."""
    table = None
    for tokens, by_name in medians.items():
        point = dispatch_table.point_record({name: _record(us) for name, us in by_name.items()})
        table = dispatch_table.merge(table, gpu, {"date": "2026-11-30T00:00:00+00:00"}, shape.name,
                                     _dims(shape, tokens), tokens, point)
    path = directory / f"{dispatch.gpu_slug(gpu)}.json"
    path.write_text(json.dumps(table))
    dispatch.load_table.cache_clear()
    return path


def _fastest(point: dict[str, Any], policy: str, weight_format: str = "bf16") -> str | None:
    """The candidate of ``policy`` with the least worst slowdown over the point's routings (one routing: the fastest)
    among those "ok" under every routing, computed here independently of kernels.dispatch."""
    runs = [point, *point.get("routings", {}).values()]
    ok = [n for n in dispatch.FORMAT_CANDIDATES[weight_format][policy]
          if all(r["median_us"].get(n) is not None and r["status"].get(n) == "ok" for r in runs)]
    if not ok:
        return None
    worst = [(max(r["median_us"][n] / min(r["median_us"][m] for m in ok) for r in runs), n) for n in ok]
    return min(worst)[1]


def test_gpu_slug() -> None:
    assert dispatch.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert dispatch.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    with pytest.raises(ValueError, match="GPU name"):
        dispatch.gpu_slug("  ")


def test_policies_and_candidates() -> None:
    assert dispatch.POLICIES == ("fastest", "warp_decode", "batch_invariant")
    assert dispatch.CANDIDATES == (S, B, M, P, G, EC) and EC == "cupy:expert-centric"
    assert M == "cupy:warp-decode-mma" and not dispatch.registered(X) and dispatch.registered(M)
    assert dispatch.POLICY_CANDIDATES == {"fastest": (S, B, M, P, G, EC), "warp_decode": (S, B, M, P, G),
                                          "batch_invariant": (P, G)}
    assert set(dispatch.BATCHED_PATHS) >= {B, M, P, G} and X not in dispatch.BATCHED_PATHS
    assert {name: dispatch.BATCHED_PATHS[name] for name in (B, M, P, G)} == {
        B: ("fma", {}), M: ("mma", {}), P: ("pairs", {}), G: ("mma", mma.grouped_knobs(get_format("bf16")))}
    for bad in ("Fastest", "classical", None, 3):
        with pytest.raises(ValueError, match=r"policy must be one of \('fastest', 'warp_decode', 'batch_invariant'\)"):
            dispatch.check_policy(bad)


@pytest.mark.parametrize("policy", ["fastest", "warp_decode"])
def test_heuristic_boundaries(policy: str) -> None:
    # qwen3 (E = 128, K = 8): strict while T*K <= E/8 (T <= 2), MMA from T*K >= E (T >= 16), batched between
    choices = {t: dispatch.heuristic(_dims(QWEN30, t), policy) for t in (1, 2, 3, 4, 8, 15, 16, 32, 64)}
    assert choices == {1: S, 2: S, 3: B, 4: B, 8: B, 15: B, 16: M, 32: M, 64: M}
    assert dispatch.heuristic(_dims(PRESETS["qwen3-235b-a22b"], 32), policy) == M
    mixtral = PRESETS["mixtral-8x7b"]  # E = 8, K = 2: T=1 shares nothing, T=2 already does, T=4 fills E
    assert [dispatch.heuristic(_dims(mixtral, t), policy) for t in (1, 2, 3, 4)] == [S, B, B, M]
    assert [dispatch.heuristic(_dims(TINY, t), policy) for t in (1, 2, 3)] == [S, B, M]  # E = 6, K = 2


def test_heuristic_never_picks_expert_centric_and_skips_what_cannot_run() -> None:
    for t in (1, 8, 64, 4096):
        assert dispatch.heuristic(_dims(QWEN30, t)) != EC
    # the balanced tensor-core down keeps DB_WARPS * T * 16 fp32 partials in shared memory (227 KB, opted into), the
    # FMA one DB_WARPS * T * DB_OUTS; the MMA path's grouped down (auto from T*K >= 2E) keeps none, so only the list
    # kernel's shared memory (two ints per pair) bounds it. Between the limits batched, beyond them strict.
    balanced_max = lists.OPT_IN_SHARED_LIMIT // (mma.MMA_DOWN_WARPS * 16 * 4)
    assert balanced_max < 2048 < fma.max_tokens() < 4096
    balanced = {"DB_GROUPED": 0, "DB_WARPS": mma.MMA_DOWN_WARPS}
    batched.family("mma").resolve(_dims(QWEN30, balanced_max), **balanced)
    with pytest.raises(ValueError, match=r"DB_WARPS \* T \* 16 fp32 partials"):
        batched.family("mma").resolve(_dims(QWEN30, balanced_max + 1), **balanced)
    assert dispatch.supported(M, _dims(QWEN30, 2048)) and not dispatch.supported(M, _dims(QWEN30, 4096))
    assert dispatch.heuristic(_dims(QWEN30, 2048)) == M and dispatch.heuristic(_dims(QWEN30, 4096)) == S
    big = _dims(QWEN30, 4096)
    assert dispatch.batched_supported(B, _dims(QWEN30, 2048)) and not dispatch.batched_supported(B, big)
    assert dispatch.heuristic(big, "warp_decode") == S
    assert not dispatch.supported(X, _dims(QWEN30, 1))  # no longer a path at all


def test_expert_centric_support_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    ec = dispatch.ec
    many = Dims(4096, 64, 64, ec.MAX_EXPERTS + 8, 8)  # too many experts for the align kernel
    assert not dispatch.expert_centric_supported(many)
    dims = _dims(QWEN30, 64)
    assert dispatch.expert_centric_supported(dims)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise ValueError("no tile knobs for these dims")

    monkeypatch.setattr(ec, "check_params", refuse)
    assert not dispatch.expert_centric_supported(dims)
    assert dispatch.supported(S, dims) and not dispatch.supported(EC, dims) and not dispatch.supported("x", dims)


def test_table_lookup(tmp_path: Path) -> None:
    gpu = "Fake GPU 9000"
    _write_table(tmp_path, gpu, QWEN30, {
        1: {S: 10.0, B: 11.0, M: 13.0, EC: 12.0},
        2: {S: 11.0, B: 10.0, M: 13.0, EC: 12.0},
        8: {S: 10.0, B: 11.0, M: 13.0, EC: 12.0},
        32: {S: 30.0, B: 12.0, M: 11.0, EC: 10.0},  # expert-centric fastest, MMA second
        64: {S: 30.0, B: 10.0, M: 9.0, EC: 11.0},  # MMA fastest, batched second
    })
    too_many = 4096  # the MMA path's list kernel cannot hold the pairs (the grouped down has no other limit)
    assert not dispatch.supported(M, _dims(QWEN30, too_many)) and dispatch.supported(M, _dims(QWEN30, 2048))
    want = {1: S, 2: B, 3: B, 7: B, 8: S, 31: S, 32: EC, 63: EC, 64: M, 2048: M, too_many: EC}  # nor batched: EC
    for tokens, choice in want.items():
        assert dispatch.choose(_dims(QWEN30, tokens), gpu, tmp_path) == (choice, "table"), tokens
    want_wd = {1: S, 2: B, 8: S, 32: M, 63: M, 64: M}
    for tokens, choice in want_wd.items():
        assert dispatch.choose(_dims(QWEN30, tokens), gpu, tmp_path, "warp_decode") == (choice, "table"), tokens
    # MMA / batched fastest at the point but impossible at this T: the next fastest runnable candidate
    assert dispatch.choose(_dims(QWEN30, 4096), gpu, tmp_path) == (EC, "table")
    assert dispatch.choose(_dims(QWEN30, 4096), gpu, tmp_path, "warp_decode") == (S, "table")
    # a shape the table does not hold, or a GPU without a table: heuristic
    other = PRESETS["qwen3-235b-a22b"]
    assert dispatch.choose(_dims(other, 64), gpu, tmp_path) == (M, "heuristic")
    assert dispatch.choose(_dims(other, 64), gpu, tmp_path, "warp_decode") == (M, "heuristic")
    assert dispatch.choose(_dims(QWEN30, 1), "Other GPU", tmp_path) == (S, "heuristic")
    with pytest.raises(ValueError, match="policy"):
        dispatch.choose(_dims(QWEN30, 1), gpu, tmp_path, "classical")


def test_table_lower_bound_below_first_point(tmp_path: Path) -> None:
    gpu = "Fake GPU 2"
    _write_table(tmp_path, gpu, QWEN30, {4: {S: 11.0, B: 10.0, EC: 12.0}, 16: {S: 10.0, B: 11.0, EC: 12.0}})
    assert dispatch.choose(_dims(QWEN30, 1), gpu, tmp_path) == (B, "table")  # first point


def test_table_points_missing_candidates_and_bad_status(tmp_path: Path) -> None:
    gpu = "Fake GPU 3"
    _write_points(tmp_path, gpu, QWEN30, {
        1: {"median_us": {S: 10.0, B: 11.0}, "status": {S: "ok", B: "ok"}},  # expert-centric not measured
        2: {"median_us": {S: 12.0, B: 11.0, EC: None}, "status": {S: "ok", B: "ok", EC: "unsupported"}},
        4: {"median_us": {S: 12.0, B: 11.0, EC: 5.0}, "status": {S: "ok", B: "ok", EC: "wrong"}},
        8: {"median_us": {S: 12.0, B: 11.0, EC: 5.0}, "status": {S: "ok", B: "error", EC: "ok"}},
        16: {"median_us": {S: 12.0, B: 11.0, EC: 5.0}, "status": {S: "wrong", B: "error", EC: "ok"}},
        32: {"median_us": {EC: 5.0, "numba:warp-decode": 1.0}, "status": {EC: "ok", "numba:warp-decode": "ok"}},
    })
    fastest = {t: dispatch.choose(_dims(QWEN30, t), gpu, tmp_path) for t in (1, 2, 4, 8, 16, 32)}
    assert fastest == {1: (S, "table"), 2: (B, "table"), 4: (B, "table"), 8: (EC, "table"), 16: (EC, "table"),
                       32: (EC, "table")}  # a non-candidate (numba) is never chosen
    warp = {t: dispatch.choose(_dims(QWEN30, t), gpu, tmp_path, "warp_decode") for t in (1, 2, 4, 8, 16, 32)}
    assert warp == {1: (S, "table"), 2: (B, "table"), 4: (B, "table"), 8: (S, "table"),
                    16: (M, "heuristic"), 32: (M, "heuristic")}  # nothing "ok" for the policy: heuristic


def test_old_format_points(tmp_path: Path) -> None:
    """Tables written before the expert-centric candidate hold only ``choice``: used when in the policy."""
    gpu = "Fake GPU 4"
    _write_points(tmp_path, gpu, QWEN30, {1: {"choice": S}, 8: {"choice": B}, 64: {"choice": EC}})
    assert dispatch.choose(_dims(QWEN30, 1), gpu, tmp_path) == (S, "table")
    assert dispatch.choose(_dims(QWEN30, 8), gpu, tmp_path, "warp_decode") == (B, "table")
    assert dispatch.choose(_dims(QWEN30, 64), gpu, tmp_path) == (EC, "table")
    assert dispatch.choose(_dims(QWEN30, 64), gpu, tmp_path, "warp_decode") == (M, "heuristic")
    assert dispatch.choose(_dims(QWEN30, 4096), gpu, tmp_path, "warp_decode") == (S, "heuristic")
    # an old batched choice that cannot run the dims: the heuristic
    _write_points(tmp_path, gpu, QWEN30, {64: {"choice": B}})
    assert dispatch.choose(_dims(QWEN30, 4096), gpu, tmp_path) == (S, "heuristic")


def test_committed_h200_table_choices() -> None:
    """The committed tables validate, were measured on their GPU, and each point's choice under each policy is
    that policy's fastest "ok" candidate (also what the tool recorded in ``choices`` / ``choice``); the candidates
    they list are today's and, as history, variants since removed (the H200's: the mixed path, never its pick)."""
    paths = sorted(dispatch.TABLE_DIR.glob("*.json"))
    assert dispatch.TABLE_DIR / "nvidia-h200.json" in paths
    for path in paths:
        table = dispatch.validate_table(json.loads(path.read_text()))
        assert path.stem == dispatch.gpu_slug(table["gpu"]) == table["slug"], path
        assert table["environment"]["gpu"]["name"] == table["gpu"], f"{path}: not measured on {table['gpu']}"
        listed = [name for name in table["candidates"] if dispatch.registered(name)]
        assert listed == list(dispatch.CANDIDATES) and table["sources"], path
        retired = dispatch_table.unregistered(table)
        assert set(table["candidates"]) - set(listed) <= set(retired), path
        assert not {c for e in table["entries"].values() for p in e["points"].values()
                    for c in (p["choice"], *p["choices"].values())} & set(retired), path
        root = Path(__file__).resolve().parents[1]
        missing = [src["file"] for src in table["sources"] if not (root / src["file"]).is_file()]
        assert not missing, f"{path} cites bench runs that are not committed: {missing}"
        for key, entry in table["entries"].items():
            for tokens, point in entry["points"].items():
                fmt = dispatch.key_format(key)  # an FP8 entry holds the FP8 candidates
                assert set(dispatch.FORMAT_CANDIDATES[fmt]["fastest"]) <= set(point["median_us"]), (path, key, tokens)
                for policy in dispatch.POLICIES:
                    want = _fastest(point, policy, fmt)
                    if policy == "batch_invariant" and want is None:  # its paths not in this table's runs yet
                        assert policy not in point["choices"]
                        continue
                    assert want is not None
                    got = dispatch.point_choice(point, policy, weight_format=fmt)
                    assert got == want == point["choices"][policy], (key, tokens)
                assert point["choice"] == point["choices"]["fastest"]
    # what the H200 table says today: every entry built from runs with a fresh routing per sample and layer copy
    # (results/h200-2026-12-04-sampled-candidates-*.json, the best worst case over uniform and Zipf routing). On
    # every format the per-pair tensor-core form leads while pairs are few (bf16 rows: strict at qwen3-30b T = 1),
    # the grouped form at qwen3-235b T = 4 (and bf16 T = 8 / 16, bf16-t16 T = 16, bf16 rows qwen3-30b T = 16), the
    # tensor-core path elsewhere; the invariant policy per-pair up to T = 4 at qwen3-30b (2 at qwen3-235b), grouped
    # from there
    assert dispatch_table.unregistered(json.loads((dispatch.TABLE_DIR / "nvidia-h200.json").read_text())) == [X]
    dispatch.load_table.cache_clear()
    G8, GT = dispatch.FP8_MMA_GROUPED, dispatch.T16_MMA_GROUPED
    bm, bp = dispatch.T16_MMA, dispatch.T16_MMA_PAIRS
    table = {  # (model, format): (fastest from T = 1 to 64, the invariant policy's per-pair limit)
        ("qwen3-30b-a3b", "bf16"): ((S, P, P, M, G, M, M), 4),
        ("qwen3-235b-a22b", "bf16"): ((P, P, G, G, G, M, M), 2),
        ("qwen3-30b-a3b", "fp8-block128"): ((FP, FP, FP, FM, FM, FM, FM), 4),
        ("qwen3-235b-a22b", "fp8-block128"): ((FP, FP, G8, FM, FM, FM, FM), 2),
        ("qwen3-30b-a3b", "fp8-block128-t16"): ((TP, TP, TP, TM, TM, TM, TM), 4),
        ("qwen3-235b-a22b", "fp8-block128-t16"): ((TP, TP, TG, TM, TM, TM, TM), 2),
        ("qwen3-30b-a3b", "bf16-t16"): ((bp, bp, bp, bm, bm, bm, bm), 4),
        ("qwen3-235b-a22b", "bf16-t16"): ((bp, bp, GT, bm, GT, bm, bm), 2),
    }
    for (model, fmt), (fastest, per_pair_up_to) in table.items():
        pair, grouped = dispatch.INVARIANT_PATHS[fmt]
        for tokens, path in zip(dispatch.TABLE_POINTS, fastest, strict=True):
            dims = _dims(PRESETS[model], tokens)
            for policy in ("fastest", "warp_decode"):
                assert dispatch.choose(dims, "NVIDIA H200", policy=policy, weight_format=fmt) == (path, "table"), (
                    model, fmt, tokens, policy)
            assert dispatch.choose(dims, "NVIDIA H200", policy="batch_invariant", weight_format=fmt) == (
                pair if tokens <= per_pair_up_to else grouped, "table"), (model, fmt, tokens)


def test_validate_table_rejects_bad_tables() -> None:
    with pytest.raises(ValueError, match="schema"):
        dispatch.validate_table({"gpu": "x"})
    good = {"schema": dispatch.SCHEMA, "gpu": "g", "date": "d",
            "entries": {"k": {"points": {"1": {"choice": S}, "2": {"choice": EC},
                                         "4": {"median_us": {S: 2.0, EC: None}, "status": {S: "ok", EC: "error"}}}}}}
    assert dispatch.validate_table(good) is good

    def broken(**point: Any) -> dict[str, Any]:
        bad = json.loads(json.dumps(good))
        bad["entries"]["k"]["points"]["1"] = point
        return bad

    with pytest.raises(ValueError, match="choice"):
        dispatch.validate_table(broken(choice="cupy:auto"))
    with pytest.raises(ValueError, match="median_us and status"):
        dispatch.validate_table(broken(tbps={S: 1.0}))
    with pytest.raises(ValueError, match="objects"):
        dispatch.validate_table(broken(median_us={S: 1.0}))
    with pytest.raises(ValueError, match="positive number"):
        dispatch.validate_table(broken(median_us={S: -1.0}, status={S: "ok"}))
    with pytest.raises(ValueError, match="measured correctly"):
        dispatch.validate_table(broken(median_us={S: 1.0, B: 2.0}, status={S: "wrong", B: "error"}))
    bad = json.loads(json.dumps(good))
    bad["entries"]["k"]["points"] = {"zero": {"choice": S}}
    with pytest.raises(ValueError, match="batch size"):
        dispatch.validate_table(bad)


def test_tool_winner_and_point() -> None:
    records = {S: _record(12.0), B: _record(10.0, "wrong"), EC: _record(5.0, "error"),
               "numba:warp-decode": _record(1.0)}
    assert dispatch_table.winner(records) == S  # wrong / failed results and non-candidates never win
    records[EC]["status"] = "ok"
    assert dispatch_table.winner(records) == EC
    assert dispatch_table.winner(records, "warp_decode") == S
    records[B]["status"] = "ok"
    point = dispatch_table.point_record(records)
    assert point["choice"] == EC and point["choices"] == {"fastest": EC, "warp_decode": B}
    assert point["slowdown_of_others"][S] == pytest.approx(12.0 / 5.0)
    assert dispatch_table.point_record({S: _record(None, "error")}) is None


def test_choice_by_the_worst_case_over_routings() -> None:
    """The routing is unknown when the path is picked: a path fastest under uniform routing but 30 % behind under
    Zipf loses to one within 2 % under both; a path wrong under any routing is never chosen."""
    uniform = {S: _record(100.0), B: _record(102.0), M: _record(150.0), EC: _record(140.0)}
    zipf = {S: _record(130.0), B: _record(100.0), M: _record(99.0, "wrong"), EC: _record(120.0)}
    point = dispatch_table.point_record(uniform, skewed={"zipf": zipf})
    assert point["choice"] == B and point["choices"] == {"fastest": B, "warp_decode": B}
    assert point["worst_slowdown"][S] == pytest.approx(1.3) and point["worst_slowdown"][B] == pytest.approx(1.02)
    assert M not in point["worst_slowdown"]  # wrong under Zipf: out, though fastest there
    assert point["routings"]["zipf"]["median_us"][S] == 130.0 and point["median_us"][S] == 100.0
    assert dispatch_table.point_record(uniform)["choice"] == S  # uniform alone: the fastest
    table = dispatch_table.merge(None, "NVIDIA H200", {"date": "2026-12-01"}, "qwen3-30b-a3b",
                                 _dims(PRESETS["qwen3-30b-a3b"], 16), 16, point)
    assert dispatch.validate_table(table) is table
    zipf[B] = _record(100.0, "error")
    assert dispatch_table.point_record(uniform, skewed={"zipf": zipf})["choice"] == S  # 1.083 (Zipf) vs EC's 1.4
    broken = json.loads(json.dumps(table))
    broken["entries"][dispatch.shape_key(_dims(PRESETS["qwen3-30b-a3b"], 16))]["points"]["16"]["routings"] = {
        "zipf": {"median_us": {S: -1.0}, "status": {S: "ok"}}}
    with pytest.raises(ValueError, match=r"\(zipf\): median_us"):
        dispatch.validate_table(broken)


def test_table_from_uniform_and_zipf_bench_runs() -> None:
    """--from-bench joins a skewed run's complete points to the uniform ones; the choice is the best worst case."""
    uniform = _bench("2026-12-01T00:00:00Z", [_bench_row(n, 16, us) for n, us in
                                               ((S, 250.0), (B, 200.0), (X, 180.0), (M, 182.0), (EC, 210.0),
                                                (P, 260.0), (G, 185.0))])
    zipf = _bench("2026-12-01T00:05:00Z", [_bench_row(n, 16, us) for n, us in
                                            ((S, 240.0), (B, 190.0), (X, 170.0), (M, 150.0), (EC, 160.0),
                                             (P, 250.0), (G, 153.0))],
                  routing="zipf")
    point = next(iter(dispatch_table.from_benches([("u.json", uniform), ("z.json", zipf)])["entries"].values()))[
        "points"]["16"]
    assert point["choice"] == M  # 1.011 worst (uniform) against the grouped path's 1.020 (Zipf)
    assert point["choices"]["batch_invariant"] == G  # its own pair: the grouped path's 1.02 (Zipf)
    assert point["routings"]["zipf"]["median_us"][M] == 150.0
    assert X not in point["median_us"] and X not in point["routings"]["zipf"]["median_us"]  # an old run's mixed rows
    uniform_only = dispatch_table.from_benches([("u.json", uniform)])
    assert next(iter(uniform_only["entries"].values()))["points"]["16"]["choice"] == M  # not the faster mixed path


def test_a_table_naming_a_removed_variant(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A table measured while the mixed path was a candidate keeps it as history: in the candidates, medians and
    even as a point's recorded choice (an old-format point's only one). The dispatch never picks it -- the point's
    fastest candidate of today, or the heuristic where the point offers none -- and never fails on it; the tool names
    it on stderr (--check, --from-bench) and skips a bench run's rows of it."""
    gpu = "Fake GPU 5"
    _write_table(tmp_path, gpu, QWEN30, {8: {S: 12.0, B: 11.0, M: 10.0, EC: 13.0}, 16: {S: 30.0, B: 12.0, M: 11.0}})
    path = tmp_path / f"{dispatch.gpu_slug(gpu)}.json"
    table = json.loads(path.read_text())
    table["candidates"] = [S, B, X, M, P, G, EC]
    for point in table["entries"][dispatch.shape_key(_dims(QWEN30, 8))]["points"].values():
        for run in dispatch.point_routings(point).values():
            run["median_us"][X], run["status"][X] = 5.0, "ok"  # fastest of all, once
        point["choice"] = point["choices"]["fastest"] = X
    table["entries"]["H64-I32-E16-K2"] = {"model": "old", "points": {"1": {"choice": X}}}  # an old-format point
    path.write_text(json.dumps(table))
    dispatch.load_table.cache_clear()
    assert dispatch.validate_table(json.loads(path.read_text()))
    assert dispatch.choose(_dims(QWEN30, 8), gpu, tmp_path) == (M, "table")
    assert dispatch.choose(_dims(QWEN30, 16), gpu, tmp_path, "warp_decode") == (M, "table")
    old = Dims(1, 64, 32, 16, 2)
    assert dispatch.choose(old, gpu, tmp_path) == (dispatch.heuristic(old), "heuristic")
    assert dispatch_table.unregistered(table) == [X]
    assert [row["pick"] for row in dispatch_table.pick_costs(table)] == [M, M]
    assert dispatch_table.main(["--json", str(path), "--check"]) == 0
    printed = capsys.readouterr()
    assert f"names 1 variant(s) no longer registered ({X})" in printed.err and X not in printed.out
    bench = _bench("2026-12-05T00:00:00Z", [_bench_row(n, 32, us) for n, us in
                                            ((S, 400.0), (B, 300.0), (M, 200.0), (EC, 250.0), (P, 500.0),
                                             (G, 210.0), (X, 100.0))], gpu=gpu)
    (tmp_path / "run.json").write_text(json.dumps(bench))
    assert dispatch_table.main(["--json", str(path), "--from-bench", str(tmp_path / "run.json")]) == 0
    printed = capsys.readouterr()
    assert f"run.json measured 1 variant(s) no longer registered ({X}): their rows are skipped" in printed.err
    assert f"{path} names 1 variant(s) no longer registered" in printed.err  # the history kept from before
    merged = dispatch.validate_table(json.loads(path.read_text()))
    points = merged["entries"][dispatch.shape_key(_dims(QWEN30, 32))]["points"]
    assert points["32"]["choice"] == M and X not in points["32"]["median_us"]
    assert X in merged["entries"][dispatch.shape_key(_dims(QWEN30, 8))]["points"]["8"]["median_us"]
    assert merged["candidates"] == list(dispatch.CANDIDATES)
    dispatch.load_table.cache_clear()


@pytest.mark.parametrize("routing", ["zipf", "uniform,nope", "uniform,zipf,zipf", ""])
def test_tool_rejects_bad_routings(tmp_path: Path, routing: str) -> None:
    """--routing: distinct generator names, uniform first (the choice's reference), else exit 2 before any work."""
    with pytest.raises(SystemExit) as stop:
        dispatch_table.main(["--json", str(tmp_path / "x.json"), "--routing", routing])
    assert stop.value.code == 2 and not (tmp_path / "x.json").exists()


def test_tool_refuses_without_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tools import harness

    if harness.gpu_available()[0]:
        pytest.skip("needs a machine without a CUDA GPU (checks the refusal there)")
    assert dispatch_table.main(["--json", str(tmp_path / "x.json"), "--model", "tiny", "--batch", "1"]) == 2
    assert not (tmp_path / "x.json").exists()


def _bench_row(variant: str, batch: int, median: float, status: str = "ok", routing: str | None = None) -> dict:
    row = {"model": "qwen3-30b-a3b", "variant": variant, "batch": batch, "median_us": median, "status": status,
           "tbps": 1.0, "bytes": {"unique_experts": 8}}
    if routing is not None:
        row["routing"] = routing
    return row


def _bench(date: str, rows: list[dict], routing: str = "uniform", gpu: str = "NVIDIA H200") -> dict:
    return {"environment": {"date": date, "gpu": {"name": gpu}}, "config": {"routing": routing}, "results": rows}


def test_table_from_a_bench_run() -> None:
    """--from-bench turns a bench JSON into a table: per (model, batch) the fastest correct candidate per policy."""
    bench = _bench("2026-11-30T00:00:00Z", [
        _bench_row(S, 1, 26.0), _bench_row(B, 1, 28.0), _bench_row(M, 1, 30.0), _bench_row(EC, 1, 40.0),
        _bench_row(S, 8, 140.0), _bench_row(B, 8, 130.0), _bench_row(M, 8, 135.0), _bench_row(EC, 8, 150.0),
        _bench_row(S, 64, 900.0), _bench_row(B, 64, 500.0, status="wrong"), _bench_row(M, 64, 450.0, status="error"),
        _bench_row(EC, 64, 400.0), _bench_row(X, 1, 1.0), _bench_row(X, 8, 1.0), _bench_row(X, 64, 1.0),  # retired
        *[_bench_row(n, t, us) for t, us in ((1, 27.0), (8, 150.0), (64, 960.0)) for n in (P, G)],
        _bench_row(S, 2, 30.0), _bench_row(B, 2, 31.0), _bench_row(M, 2, 32.0),  # EC not measured: no point
        _bench_row("numba:warp-decode", 1, 1.0), _bench_row("cupy:auto", 1, 1.0),  # never candidates (nor X)
    ])
    table = dispatch_table.from_bench(bench, name="run.json")
    points = next(iter(table["entries"].values()))["points"]
    assert {t: p["choices"] for t, p in points.items()} == {
        "1": {"fastest": S, "warp_decode": S, "batch_invariant": G}, "8": {"fastest": B, "warp_decode": B,
                                                                         "batch_invariant": G},
        "64": {"fastest": EC, "warp_decode": S, "batch_invariant": G}}  # P, G tied: the alphabetically first
    assert set(points["1"]["median_us"]) == set(dispatch.CANDIDATES)
    assert table["gpu"] == table["environment"]["gpu"]["name"] == "NVIDIA H200"
    assert table["sources"] == [{"file": "run.json", "date": "2026-11-30T00:00:00Z", "gpu": "NVIDIA H200"}]
    with pytest.raises(ValueError, match="uniform"):
        dispatch_table.from_bench({**bench, "config": {"routing": "zipf"}})


def test_table_from_several_bench_runs(tmp_path: Path) -> None:
    """Later files override the same variant at the same (model, batch); only uniform-routing rows count."""
    evening = _bench("2026-11-30T18:58:00Z", [
        _bench_row(S, 1, 23.0), _bench_row(B, 1, 28.0), _bench_row(M, 1, 33.0), _bench_row(EC, 1, 40.0),
        _bench_row(S, 32, 530.0), _bench_row(B, 32, 368.0), _bench_row(M, 32, 310.0), _bench_row(EC, 32, 314.0),
        _bench_row(X, 1, 29.0), _bench_row(X, 32, 320.0),
        *[_bench_row(n, t, 1000.0) for t in (1, 32) for n in (P, G)],
    ])
    final = _bench("2026-11-30T19:08:00Z", [
        _bench_row(S, 1, 22.0), _bench_row(B, 1, 20.0),
        _bench_row(B, 32, 300.0), _bench_row(EC, 32, 1.0, routing="zipf"),  # a zipf row never counts
    ])
    zipf_run = _bench("2026-11-30T19:09:00Z", [_bench_row(EC, 1, 1.0)], routing="zipf")
    paths = []
    for name, run in (("evening.json", evening), ("final.json", final), ("zipf.json", zipf_run)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "nvidia-h200.json"
    assert dispatch_table.main(["--json", str(out), "--from-bench", *map(str, paths)]) == 0
    table = dispatch.validate_table(json.loads(out.read_text()))
    points = next(iter(table["entries"].values()))["points"]
    assert points["1"]["median_us"] == {S: 22.0, B: 20.0, M: 33.0, EC: 40.0, P: 1000.0, G: 1000.0}  # no mixed row
    assert points["1"]["sources"] == {S: "final.json", B: "final.json", M: "evening.json", EC: "evening.json",
                                      P: "evening.json", G: "evening.json"}
    assert points["1"]["choices"] == {"fastest": B, "warp_decode": B, "batch_invariant": G}
    assert points["32"]["median_us"] == {S: 530.0, B: 300.0, M: 310.0, EC: 314.0, P: 1000.0, G: 1000.0}
    assert points["32"]["choices"] == {"fastest": B, "warp_decode": B, "batch_invariant": G}
    assert [s["file"] for s in table["sources"]] == ["evening.json", "final.json", "zipf.json"]
    assert table["date"] == "2026-11-30T19:08:00Z"  # the latest run that gave rows (zipf.json gave none)
    other = _bench("2026-12-01T00:00:00Z", evening["results"], gpu="NVIDIA B200")
    with pytest.raises(ValueError, match="different GPUs"):
        dispatch_table.from_benches([("a.json", evening), ("b.json", other)])


def test_input_errors_before_any_device_call() -> None:
    problem = make_problem("tiny", 2, seed=1)
    with pytest.raises(TypeError, match="cupy"):
        dispatch.moe_decode(*problem.arrays)
    fakes = [FakeCupyArray(a.shape, a.dtype) for a in problem.arrays]
    with pytest.raises(TypeError, match="workspace"):
        dispatch.moe_decode(*fakes, workspace=object())
    ws = dispatch.Workspace(_dims(problem.shape, 3), S, "heuristic", None)
    with pytest.raises(ValueError, match="workspace was made for"):
        dispatch.moe_decode(*fakes, workspace=ws)
    ws = dispatch.Workspace(_dims(problem.shape, 2), B, "heuristic", None, policy="warp_decode")
    with pytest.raises(ValueError, match="policy 'warp_decode', this call uses policy 'fastest'"):
        dispatch.moe_decode(*fakes, workspace=ws)
    with pytest.raises(ValueError, match="policy must be one of"):
        dispatch.moe_decode(*fakes, workspace=ws, policy="accurate")
    with pytest.raises(ValueError, match="policy must be one of"):
        dispatch.make_workspace(_dims(problem.shape, 2), "NVIDIA H200", policy="accurate")
    fakes[3] = FakeCupyArray((2, 2), np.int64)
    with pytest.raises(TypeError, match="topk_ids"):
        dispatch.moe_decode(*fakes)
    with pytest.raises(TypeError, match="Dims"):
        dispatch.choose((1, 2, 3, 4, 5), "NVIDIA H200")


def test_api_moe_decode_passes_the_policy() -> None:
    import inspect

    from kernels import api

    assert inspect.signature(api.moe_decode).parameters["policy"].default == "fastest"
    fakes = [FakeCupyArray(a.shape, a.dtype) for a in make_problem("tiny", 2, seed=1).arrays]
    with pytest.raises(ValueError, match="policy must be one of"):
        api.moe_decode(*fakes, policy="nope")


def test_variants_registered() -> None:
    from kernels.variants import REGISTRY, load_builtin

    load_builtin()
    for name in ("cupy:auto", "cupy:auto-warp-decode"):
        variant = REGISTRY[name]
        assert variant.family == "auto" and variant.params == {}
        assert variant.kernel_family is None and variant.source is None  # composes the registered variants
        with pytest.raises(ValueError, match="no knobs"):
            variant.build(_dims(QWEN30, 1), GB_OUTS=2)
    with pytest.raises(ValueError, match="policy"):
        dispatch.build(_dims(QWEN30, 1), "nope")


@pytest.mark.parametrize("policy", ["fastest", "warp_decode"])
def test_build_returns_the_chosen_launch(monkeypatch: pytest.MonkeyPatch, policy: str) -> None:
    """build(dims) makes the chosen variant's launch (no GPU: a stand-in variant) and returns a Launch running the
    same work (run, stages, knobs, workspace), stating the chosen path's numerics and the decision as facts."""
    from kernels.family import Launch
    from kernels.variants import Variant

    dims = _dims(TINY, 4)
    calls: list[tuple[str, Any]] = []

    def run(*arrays: Any) -> None:
        calls.append(("run", arrays))

    def stages(*arrays: Any) -> list[tuple[str, Any]]:
        return [("only", lambda: calls.append(("stage", arrays)))]

    made: list[tuple[Dims, dict[str, Any]]] = []

    def build(got: Dims, **params: Any) -> Launch:
        made.append((got, params))
        return Launch(run=run, stages=stages, params={"BLOCK_N": 32}, workspace="ws", facts={"inner": 1})

    chosen = Variant(name=EC, backend="cupy", family="expert-centric", build=build, reference_mode="classical",
                     quant="fp8", params={"fuse_scatter": True})
    asked: list[tuple[Any, ...]] = []

    def choose(got: Dims, gpu: Any = None, table_dir: Any = None, policy: str = "fastest",
               weight_format: str = "bf16") -> tuple[str, str]:
        assert weight_format == "bf16"
        asked.append((got, policy))
        return EC, "table"

    monkeypatch.setattr(dispatch, "choose", choose)
    monkeypatch.setattr(dispatch, "get_variant", lambda name: chosen if name == EC else None)
    variant = dispatch.VARIANT if policy == "fastest" else dispatch.VARIANT_WARP_DECODE
    launch = variant.make(dims)
    assert asked == [(dims, policy)] and made == [(dims, {"fuse_scatter": True})]
    assert isinstance(launch, Launch)
    assert (launch.reference_mode, launch.quant) == ("classical", "fp8")
    assert launch.facts == {"inner": 1, "choice": EC, "choice_source": "table", "policy": policy}
    assert (dict(launch.params), launch.workspace) == ({"BLOCK_N": 32}, "ws")
    launch(1, 2, 3, 4, 5, 6)
    [(name, stage)] = launch.stages(1, 2, 3, 4, 5, 6)
    stage()
    assert name == "only" and calls == [("run", (1, 2, 3, 4, 5, 6)), ("stage", (1, 2, 3, 4, 5, 6))]


# ---------------------------------------------------------------------------------------------------
# The bench harness checks a launch against its own numerics (NumPy stand-in for CuPy, no GPU)
# ---------------------------------------------------------------------------------------------------
def test_harness_checked_as() -> None:
    from kernels.family import Launch
    from kernels.variants import Variant
    from tools import harness

    variant = Variant(name="fake:v", backend="cupy", family="x", build=lambda dims: None, quant=None)

    def run(*arrays: Any) -> None:
        pass

    assert harness.checked_as(variant, Launch(run=run)) is variant  # a launch stating nothing: the variant's
    checked = harness.checked_as(variant, Launch(run=run, reference_mode="classical"))
    assert (checked.reference_mode, checked.quant) == ("classical", None)
    checked = harness.checked_as(variant, Launch(run=run, reference_mode="classical", quant="fp8"))
    assert (checked.reference_mode, checked.quant) == ("classical", "fp8")


def _auto_like_variant(announce: bool) -> Any:
    """A stand-in 'auto' variant (reference_mode warp_decode) whose launch computes the classical fp8 path and,
    with ``announce``, says so (``launch.reference_mode`` / ``quant``) with a choice in its facts, as
    dispatch.build does."""
    from kernels.family import Launch
    from kernels.reference import moe_decode
    from kernels.variants import Variant

    def build(dims: Dims, **params: Any) -> Launch:
        import cupy

        def compute(x: Any, w13: Any, w2: Any, ids: Any, weights: Any, out: Any) -> None:
            out[...] = moe_decode(x, w13, w2, ids, weights, mode="classical", quant="fp8")

        def run(*args: Any) -> None:
            cupy.cuda.get_current_stream().run(lambda: compute(*args))

        if announce:
            return Launch(run=run, reference_mode="classical", quant="fp8",
                          facts={"choice": "cupy:expert-centric-fp8", "choice_source": "table", "policy": "fastest"})
        return Launch(run=run)

    return Variant(name="fake:auto", backend="cupy", family="auto", build=build, reference_mode="warp_decode")


def test_harness_honours_launch_reference_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_bench import _fake_cupy
    from tools import harness

    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(harness, "TARGET_SAMPLE_US", 1.0)
    work = harness.Workbench(TINY, 5, "uniform", seed=1)
    try:
        row = work.measure(_auto_like_variant(announce=True), repeats=2, stages=False)
        assert row["status"] == "ok", row["error"]
        assert (row["reference_mode"], row["quant"]) == ("classical", "fp8")
        assert (row["check"]["mode"], row["check"]["quant"], row["check"]["max_ulp"]) == ("classical", "fp8", 0)
        assert (row["choice"], row["choice_source"]) == ("cupy:expert-centric-fp8", "table")
        # the same output checked against the variant's own mode (warp_decode) is wrong: the check is real
        silent = work.measure(_auto_like_variant(announce=False), repeats=2, stages=False)
        assert silent["status"] == "wrong" and silent["reference_mode"] == "warp_decode"
        assert "choice" not in silent
    finally:
        work.free()


# ---------------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------------


def _path_call(choice: str) -> Any:
    """The chosen path called directly: strict, expert-centric, or the batched family with that path's knobs."""
    if choice in dispatch.BATCHED_PATHS:
        path, knobs = dispatch.BATCHED_PATHS[choice]
        return lambda *arrays: batched.warp_decode_batched(*arrays, path=path, **knobs)
    return {S: dispatch.wdc.warp_decode, EC: dispatch.ec.expert_centric}[choice]


def _tensor_core(choice: str) -> bool:
    """Whether ``choice`` sums in the tensor core's order (the tensor-core and per-pair families)."""
    return dispatch.BATCHED_PATHS.get(choice, ("", {}))[0] in ("mma", "pairs")


def _check_chosen_mode(cupy: Any, got: np.ndarray, problem: Any, choice: str, what: str) -> None:
    """``got`` against reference.moe_decode in the chosen path's mode (and the fp64 oracle)."""
    from kernels.numerics import rel_l2
    from kernels.reference import moe_decode

    mode = get_variant(choice).reference_mode
    if mode == "warp_decode":
        faithful, oracle = _references(problem)
        _assert_matches(got, faithful, oracle, what, own_order=_tensor_core(choice))  # the tensor core's sum order
        return
    from tests.test_expert_centric import _check_close, _f32

    assert (mode, get_variant(choice).quant) == ("classical", None), what
    host = problem.compact()
    _check_close(got, moe_decode(*host.arrays, mode="classical"))
    assert rel_l2(_f32(got), moe_decode(*host.arrays, mode="fp64")) < 1.5e-2, what


def _run_three_times(cupy: Any, problem: Any, ws: dispatch.Workspace, policy: str) -> np.ndarray:
    """Three poisoned runs with out + workspace; bitwise identical; returns the first."""
    runs = []
    for _ in range(3):
        out = _poisoned_out(cupy, problem.tokens, problem.shape.hidden)
        assert dispatch.moe_decode(*problem.arrays, out=out, workspace=ws, policy=policy) is out
        cupy.cuda.runtime.deviceSynchronize()
        runs.append(cupy.asnumpy(out))
    for run in runs[1:]:
        assert np.array_equal(run.view(np.uint16), runs[0].view(np.uint16)), f"{ws.choice}: not repeatable"
    return runs[0]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, policy", [(1, "fastest"), (3, "fastest"), (8, "fastest"), (64, "fastest"),
                                            (64, "warp_decode")])
def test_moe_decode_equals_chosen_path(cupy_mod: Any, rng: np.random.Generator, tokens: int, policy: str) -> None:
    """qwen3-30b on this GPU's table: on the H200 strict at T=1, per-pair at 3, MMA at 8 and 64 (both policies)."""
    cupy = cupy_mod
    problem = make_problem("qwen3-30b-a3b", tokens, seed=_seed(rng), xp=cupy)
    dims = _dims(problem.shape, tokens)
    ws = dispatch.make_workspace(dims, policy=policy)
    assert ws.policy == policy and ws.choice in dispatch.POLICY_CANDIDATES[policy]
    got = _run_three_times(cupy, problem, ws, policy)
    expected = cupy.asnumpy(_path_call(ws.choice)(*problem.arrays)).view(np.uint16)
    assert np.array_equal(got.view(np.uint16), expected), ws.choice
    _check_chosen_mode(cupy, got, problem, ws.choice, f"auto T={tokens} {policy} ({ws.choice}, {ws.source})")
    allocating = dispatch.moe_decode(*problem.arrays, policy=policy)
    assert allocating.dtype == BF16 and np.array_equal(cupy.asnumpy(allocating).view(np.uint16), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("policy, expected", [("fastest", EC), ("warp_decode", B)], ids=["fastest", "warp_decode"])
def test_fabricated_table_picks_expert_centric(cupy_mod: Any, rng: np.random.Generator, tmp_path: Path,
                                               policy: str, expected: str) -> None:
    """A table saying expert-centric is fastest at tiny T=4 (where the heuristic says MMA)."""
    cupy = cupy_mod
    gpu = "Fabricated GPU"
    _write_table(tmp_path, gpu, TINY, {4: {S: 12.0, B: 11.0, M: 11.5, EC: 10.0}})
    problem = make_problem("tiny", 4, seed=_seed(rng), routing="zipf", xp=cupy)
    dims = _dims(TINY, 4)
    assert dispatch.heuristic(dims) == M
    ws = dispatch.make_workspace(dims, gpu, policy=policy, table_dir=tmp_path)
    assert (ws.choice, ws.source, ws.policy) == (expected, "table", policy)
    got = _run_three_times(cupy, problem, ws, policy)
    assert np.array_equal(got.view(np.uint16), cupy.asnumpy(_path_call(expected)(*problem.arrays)).view(np.uint16))
    _check_chosen_mode(cupy, got, problem, expected, f"fabricated table, {policy}")
    other = "warp_decode" if policy == "fastest" else "fastest"
    with pytest.raises(ValueError, match="policy"):
        dispatch.moe_decode(*problem.arrays, out=_poisoned_out(cupy, 4, TINY.hidden), workspace=ws, policy=other)


def _capture_and_replay(cupy: Any, rng: np.random.Generator, problem: Any, ws: dispatch.Workspace, launch: Any,
                        policy: str, what: str) -> None:
    """Capture moe_decode (out + workspace) and the auto variant's launch in one graph, replay it twice with new
    routing and inputs written into the same buffers, check both outputs against the chosen path's mode."""
    from tests.test_warp_decode_batched import write_fresh_inputs

    dims = ws.dims
    outs = [_poisoned_out(cupy, dims.tokens, dims.hidden) for _ in range(2)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        dispatch.moe_decode(*problem.arrays, out=outs[0], workspace=ws, policy=policy)  # compile outside capture
        launch(*problem.arrays, outs[1])
        stream.synchronize()
        for o in outs:
            o.view(cupy.uint16).fill(0x7FC0)
        stream.synchronize()
        dispatch.load_table.cache_clear()
        dispatch._device_name.cache_clear()
        stream.begin_capture()
        assert dispatch.choose(dims, policy=policy) == (ws.choice, ws.source)  # the decision is capture-safe
        dispatch.moe_decode(*problem.arrays, out=outs[0], workspace=ws, policy=policy)  # no host sync
        launch(*problem.arrays, outs[1])
        graph = stream.end_capture()
    for round_ in range(2):
        with stream:
            graph.launch(stream)
            stream.synchronize()
        cupy.cuda.runtime.deviceSynchronize()
        results = [cupy.asnumpy(o) for o in outs]
        assert np.array_equal(results[0].view(np.uint16), results[1].view(np.uint16)), f"{what} replay {round_}"
        for result, name in zip(results, ("moe_decode", "variant"), strict=True):
            _check_chosen_mode(cupy, result, problem, ws.choice, f"{what} {name} replay {round_}")
        with stream:  # on the replay's stream: a non-blocking stream does not wait for the legacy default stream
            write_fresh_inputs(cupy, problem, _seed(rng))
            for o in outs:
                o.view(cupy.uint16).fill(0x7FC0)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [2, 16])
def test_capture_moe_decode_and_auto_variant(cupy_mod: Any, rng: np.random.Generator, tokens: int) -> None:
    from kernels.family import Launch

    cupy = cupy_mod
    problem = make_problem("qwen3-30b-a3b", tokens, seed=_seed(rng), xp=cupy)
    dims = _dims(problem.shape, tokens)
    ws = dispatch.make_workspace(dims)
    launch = dispatch.VARIANT.make(dims)
    assert isinstance(launch, Launch)
    assert (launch.facts["choice"], launch.facts["choice_source"], launch.facts["policy"]) == (ws.choice, ws.source,
                                                                                              "fastest")
    assert (launch.reference_mode, launch.quant) == (get_variant(ws.choice).reference_mode,
                                                     get_variant(ws.choice).quant)
    _capture_and_replay(cupy, rng, problem, ws, launch, "fastest", f"qwen3-30b T={tokens}")


@pytest.mark.gpu
@pytest.mark.parametrize("policy, variant, expected", [("fastest", "cupy:auto", M),
                                                       ("warp_decode", "cupy:auto-warp-decode", M)],
                         ids=["fastest", "warp_decode"])
def test_capture_policies_tiny(cupy_mod: Any, rng: np.random.Generator, policy: str, variant: str,
                               expected: str) -> None:
    """tiny T=8 (T*K = 16 >= E = 6, no table entry): the heuristic picks the MMA path under both policies;
    equal to the MMA kernels called directly, bitwise repeatable over 3 runs, captured with new routing per
    replay, checked by the MMA rule (tests/warp_checks.py, own_order)."""

    cupy = cupy_mod
    problem = make_problem("tiny", 8, seed=_seed(rng), xp=cupy)
    dims = _dims(TINY, 8)
    ws = dispatch.make_workspace(dims, policy=policy)
    assert (ws.choice, ws.source) == (expected, "heuristic")
    launch = get_variant(variant).make(dims)
    assert (launch.facts["choice"], launch.facts["policy"]) == (expected, policy)
    assert (launch.reference_mode, launch.quant) == (get_variant(expected).reference_mode, None)
    got = _run_three_times(cupy, problem, ws, policy)
    assert np.array_equal(got.view(np.uint16), cupy.asnumpy(_path_call(expected)(*problem.arrays)).view(np.uint16))
    _check_chosen_mode(cupy, got, problem, expected, f"tiny T=8 {policy} (heuristic MMA)")
    _capture_and_replay(cupy, rng, problem, ws, launch, policy, f"tiny T=8 {policy}")


# -- FP8 weights: their own candidates, entries and heuristic ------------------------------------------------------
FS, FB, FM, FP = dispatch.FP8_STRICT, dispatch.FP8_BATCHED, dispatch.FP8_MMA, dispatch.FP8_MMA_PAIRS
FG = dispatch.FP8_MMA_GROUPED


def test_fp8_weights_choose_among_the_fp8_paths(tmp_path: Path) -> None:
    """The heuristic picks the FP8 paths by the bf16 rule, the per-pair tensor-core form in strict's place (strict
    FP8 where it cannot run: K > 16) and the tensor-core path in batched's; a table's FP8 entry (key
    ``...-fp8-block128``) is read for FP8 weights only, and its bf16 entry never answers for them (nor the other way
    round)."""
    for tokens, want in {1: FP, 2: FP, 4: FM, 8: FM, 16: FM, 64: FM}.items():
        assert dispatch.heuristic(_dims(QWEN30, tokens), weight_format="fp8-block128") == want, tokens
    assert dispatch.heuristic(Dims(1, 2048, 768, 512, 20), weight_format="fp8-block128") == FS  # K = 20 > 16
    assert dispatch.heuristic(_dims(QWEN30, 1)) == S  # bf16: strict
    assert dispatch.shape_key(_dims(QWEN30, 1), "fp8-block128") == "H2048-I768-E128-K8-fp8-block128"
    assert dispatch.key_format("H2048-I768-E128-K8-fp8-block128") == "fp8-block128"
    assert dispatch.key_format("H2048-I768-E128-K8") == "bf16"
    with pytest.raises(ValueError, match="unknown weight_format"):
        dispatch.choose(_dims(QWEN30, 1), "Fake GPU", tmp_path, weight_format="int4")
    gpu = "Fake GPU 9001"
    table = None
    for tokens, medians in {1: {FS: 10.0, FB: 12.0, FM: 14.0}, 8: {FS: 40.0, FB: 30.0, FM: 31.0},
                            32: {FS: 90.0, FB: 60.0, FM: 50.0}}.items():
        point = dispatch_table.point_record({n: _record(us) for n, us in medians.items()},
                                            weight_format="fp8-block128")
        table = dispatch_table.merge(table, gpu, {"date": "2026-12-01"}, QWEN30.name, _dims(QWEN30, tokens), tokens,
                                     point, "fp8-block128")
    point = dispatch_table.point_record({n: _record(10.0) for n in (S, B, M, EC)})
    table = dispatch_table.merge(table, gpu, {"date": "2026-12-01"}, QWEN30.name, _dims(QWEN30, 8), 8, point)
    dispatch.validate_table(table)
    (tmp_path / f"{dispatch.gpu_slug(gpu)}.json").write_text(json.dumps(table))
    dispatch.load_table.cache_clear()
    fp8 = {t: dispatch.choose(_dims(QWEN30, t), gpu, tmp_path, weight_format="fp8-block128") for t in (1, 4, 8, 40)}
    assert fp8 == {1: (FS, "table"), 4: (FS, "table"), 8: (FB, "table"), 40: (FM, "table")}
    for tokens in (1, 8, 40):  # bf16 weights: the bf16 entry (one point, every candidate tied: the first name)
        assert dispatch.choose(_dims(QWEN30, tokens), gpu, tmp_path) == (EC, "table")
    bad = json.loads(json.dumps(table))
    bad["entries"]["H2048-I768-E128-K8-fp8-block128"]["points"]["1"]["choice"] = S  # a bf16 path in an FP8 entry
    with pytest.raises(ValueError, match="is not one of"):
        dispatch.validate_table(bad)


def test_fp8_table_from_bench_rows() -> None:
    """--from-bench --weight-format fp8-block128 collects the FP8 candidates' rows into the FP8 entries."""
    bench = _bench("2026-12-01T00:00:00Z", [
        _bench_row(FS, 1, 12.0), _bench_row(FB, 1, 14.0), _bench_row(FM, 1, 16.0), _bench_row(FP, 1, 13.0),
        _bench_row(FG, 1, 15.0), _bench_row(FS, 16, 80.0), _bench_row(FB, 16, 60.0), _bench_row(FM, 16, 55.0),
        _bench_row(FP, 16, 70.0), _bench_row(FG, 16, 57.0),
        _bench_row(S, 1, 20.0),  # a bf16 path: not a candidate here
    ])
    table = dispatch_table.from_bench(bench, name="fp8.json", weight_format="fp8-block128")
    (key, entry), = table["entries"].items()
    assert key.endswith("-fp8-block128") and entry["weight_format"] == "fp8-block128"
    assert {t: p["choice"] for t, p in entry["points"].items()} == {"1": FS, "16": FM}
    assert set(entry["points"]["1"]["median_us"]) == {FS, FB, FM, FP, FG}


def test_batch_invariant_policy_keeps_one_numerics() -> None:
    """policy="batch_invariant" picks only the grouped tensor-core path or its per-pair form (one numerics): the
    per-pair form where strict would run (T*K <= E/8), the grouped one from there, for either weight format; both
    knob sets force what the numerics rest on (the grouped down at every T; no lists, a token per down block)."""
    want = {1: dispatch.MMA_PAIRS, 2: dispatch.MMA_PAIRS, 3: dispatch.MMA_GROUPED, 8: dispatch.MMA_GROUPED,
            64: dispatch.MMA_GROUPED}  # per-pair where strict would run (T*K <= E/8)
    assert {t: dispatch.heuristic(_dims(QWEN30, t), "batch_invariant") for t in want} == want
    assert dispatch.heuristic(_dims(QWEN30, 1), "batch_invariant", "fp8-block128") == dispatch.FP8_MMA_PAIRS
    assert dispatch.heuristic(_dims(QWEN30, 64), "batch_invariant", "fp8-block128") == dispatch.FP8_MMA_GROUPED
    for fmt, (pairs, grouped) in dispatch.INVARIANT_PATHS.items():  # the tensor-core family, grouped at every T
        assert dispatch.BATCHED_PATHS[grouped] == ("mma", mma.grouped_knobs(get_format(fmt)))
        assert dispatch.BATCHED_PATHS[pairs] == ("pairs", {})  # no lists, a token per down block
        for tokens in (1, 2, 64, 2048):
            resolved = get_variant(grouped).resolve(_dims(QWEN30, tokens))
            assert (resolved["DB_GROUPED"], resolved["GB_KSPLIT"]) == (1, mma.invariant_ksplit(get_format(fmt)))
            assert get_variant(pairs).resolve(_dims(QWEN30, tokens))["GB_KSPLIT"] == resolved["GB_KSPLIT"]  # one
            # numerics: the same k ranges
    many_slots = Dims(1, 64, 32, 40, 20)  # K = 20: more slots than a per-token down block has warps
    with pytest.raises(ValueError, match="K <= 16, got 20"):
        batched.family("pairs").resolve(many_slots)
    assert not dispatch.supported(dispatch.MMA_PAIRS, many_slots)
    assert dispatch.heuristic(many_slots, "batch_invariant") == dispatch.MMA_GROUPED

    for name in (dispatch.MMA_PAIRS, dispatch.MMA_GROUPED, dispatch.FP8_MMA_PAIRS, dispatch.FP8_MMA_GROUPED):
        variant = get_variant(name)
        assert variant.reference_mode == "warp_decode" and variant.weight_format == (
            "fp8-block128" if name.endswith("-fp8") else "bf16")


# -- tiled weights (fp8-block128-t16, bf16-t16): the tensor-core paths on tiles ---------------------------------------
# (tiled format, its row layout, its three paths, its auto variant, the row layout's strict path)
TILED_FORMATS = {"fp8-block128-t16": ("fp8-block128", (TM, TP, TG), "cupy:auto-fp8-t16", FS),
                 "bf16-t16": ("bf16", (dispatch.T16_MMA, dispatch.T16_MMA_PAIRS, dispatch.T16_MMA_GROUPED),
                              "cupy:auto-t16", S)}


@pytest.mark.parametrize("t16", list(TILED_FORMATS))
def test_tiled_weights_choose_among_the_tiled_paths(tmp_path: Path, t16: str) -> None:
    """Tiled weights choose among their three tiled paths under every policy (the heuristic: per-pair where strict
    would run, the tensor-core path else; the invariant policy its pair), from their own table entries (key
    ``...-<format>``, never the row layout's); dims no tiled path runs raise a ValueError that names the row layout,
    whose strict path runs them."""
    rows_fmt, (mma, pairs, grouped), auto, strict = TILED_FORMATS[t16]
    assert dispatch.FORMAT_CANDIDATES[t16]["fastest"] == (mma, pairs, grouped)
    for name, path in ((mma, "mma"), (pairs, "pairs"), (grouped, "mma")):
        assert dispatch.BATCHED_PATHS[name][0] == path and get_variant(name).weight_format == t16
    assert get_variant(auto).weight_format == t16
    for tokens, want in {1: pairs, 2: pairs, 4: mma, 8: mma, 64: mma}.items():
        assert dispatch.heuristic(_dims(QWEN30, tokens), weight_format=t16) == want, tokens
        assert dispatch.heuristic(_dims(QWEN30, tokens), "batch_invariant", t16) == (pairs if tokens <= 2 else grouped)
    too_many = Dims(4096, 64, 64, 8, 8)  # the list kernel's shared memory: no batched path runs it
    with pytest.raises(ValueError, match=f"{t16}.*list kernel.*use {rows_fmt} weights instead"):
        dispatch.heuristic(too_many, weight_format=t16)
    assert dispatch.heuristic(too_many, weight_format=rows_fmt) == strict
    assert dispatch.key_format(dispatch.shape_key(_dims(QWEN30, 1), t16)) == t16
    gpu = "Fake GPU 9002"
    table = None
    row_paths = dispatch.FORMAT_CANDIDATES[rows_fmt]["fastest"]
    rows = dict.fromkeys(row_paths, 5.0)  # faster, but the row layout's entry: never read for tiles
    for fmt, medians in ((t16, {mma: 20.0, pairs: 10.0, grouped: 30.0}), (rows_fmt, rows)):
        point = dispatch_table.point_record({n: _record(us) for n, us in medians.items()}, weight_format=fmt)
        table = dispatch_table.merge(table, gpu, {"date": "2026-12-04"}, QWEN30.name, _dims(QWEN30, 1), 1, point, fmt)
    (tmp_path / f"{dispatch.gpu_slug(gpu)}.json").write_text(json.dumps(dispatch.validate_table(table)))
    dispatch.load_table.cache_clear()
    assert dispatch.choose(_dims(QWEN30, 4), gpu, tmp_path, weight_format=t16) == (pairs, "table")
    assert dispatch.choose(_dims(QWEN30, 4), gpu, tmp_path, "batch_invariant", t16) == (pairs, "table")
    assert dispatch.choose(_dims(QWEN30, 4), gpu, tmp_path, weight_format=rows_fmt)[0] in row_paths


@pytest.mark.gpu
@pytest.mark.parametrize("t16", list(TILED_FORMATS))
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_moe_decode_on_tiled_weights(cupy_mod: Any, rng: np.random.Generator, tokens: int, t16: str) -> None:
    """moe_decode on tiled weights runs a tiled path (this GPU's table, under each policy): every row written,
    bitwise the same over repeats, as that path called directly, and as its knobs on the row layout (only the
    addresses move); a workspace made for the tiles is refused for the row layout."""
    from kernels.formats import get_format, quantize_weights

    cupy = cupy_mod
    rows_fmt = TILED_FORMATS[t16][0]
    problem = make_problem("qwen3-30b-a3b", tokens, seed=_seed(rng), xp=cupy)
    rows = quantize_weights(problem.w13, problem.w2, rows_fmt)
    tiles = get_format(t16).from_rows(*rows)
    x, ids, wts = problem.x, problem.topk_ids, problem.topk_weights
    dims = _dims(problem.shape, tokens)
    for policy in dispatch.POLICIES:
        ws = dispatch.make_workspace(dims, policy=policy, weight_format=t16)
        assert ws.choice in dispatch.FORMAT_CANDIDATES[t16][policy], (policy, ws.choice)
        runs = []
        for _ in range(2):
            out = _poisoned_out(cupy, tokens, problem.shape.hidden)
            assert dispatch.moe_decode(x, *tiles, ids, wts, out=out, workspace=ws, policy=policy) is out
            runs.append(out.get().view(np.uint16))
        assert not np.any((runs[0] & 0x7F80) == 0x7F80), f"{ws.choice}: NaN/inf (a row not written)"
        assert np.array_equal(runs[0], runs[1]), f"{ws.choice}: not repeatable"
        path, knobs = dispatch.BATCHED_PATHS[ws.choice]
        direct = batched.warp_decode_batched(x, *tiles, ids, wts, path=path, **knobs).get().view(np.uint16)
        on_rows = batched.warp_decode_batched(x, *rows, ids, wts, path=path, **knobs).get().view(np.uint16)
        assert np.array_equal(direct, runs[0]) and np.array_equal(on_rows, runs[0]), ws.choice
        with pytest.raises(ValueError, match=f"this call passes {rows_fmt} weights"):
            dispatch.moe_decode(x, *rows, ids, wts, workspace=ws, policy=policy)


def test_check_prints_what_each_pick_costs_under_each_routing(tmp_path: Path, capsys: Any) -> None:
    """--check: a pick that is fastest under uniform routing but 10 % behind under Zipf is reported over the 3 % bar,
    with the routing's fastest path named; a point where one path wins both is not."""
    from tools import dispatch_table

    def run(medians: dict[str, float]) -> dict[str, Any]:
        full = {name: 100.0 for name in dispatch.CANDIDATES} | medians
        return {"median_us": full, "status": dict.fromkeys(full, "ok")}

    split = {**run({S: 50.0, M: 60.0}), "routings": {"zipf": run({S: 55.0, M: 50.0})}}
    clear = {**run({M: 40.0}), "routings": {"zipf": run({M: 40.0})}}
    table = {"schema": dispatch.SCHEMA, "gpu": "NVIDIA H200", "date": "d",
             "entries": {"H2048-I768-E128-K8": {"model": "qwen3-30b-a3b", "points": {"4": split, "8": clear}}}}
    rows = dispatch_table.pick_costs(table)
    assert [(r["batch"], r["pick"]) for r in rows] == [(4, S), (8, M)]
    assert rows[0]["slowdown"] == {"uniform": 1.0, "zipf": pytest.approx(1.1)} and rows[0]["fastest"]["zipf"] == M
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    assert dispatch_table.main(["--json", str(path), "--check"]) == 0
    out = capsys.readouterr().out
    assert "T=4" in out and "+10.0 % (fastest cupy:warp-decode-mma)  OVER" in out
    assert "1 point(s) where the pick is more than 3 % slower" in out


def test_four_bit_weights_choose_among_their_paths(tmp_path: Path) -> None:
    """mxfp4 and nvfp4 weights (no measured entry): FP8's rule on the format's paths -- the per-pair tensor-core form
    where strict would run, the tensor-core path elsewhere, the FMA path where the per-pair form cannot run (K > 16);
    the batch-invariant pair per-pair / grouped."""
    paths = {"mxfp4": (dispatch.MX4_MMA_PAIRS, dispatch.MX4_MMA, dispatch.MX4_BATCHED, dispatch.MX4_MMA_GROUPED),
             "nvfp4": (dispatch.NV4_MMA_PAIRS, dispatch.NV4_MMA, dispatch.NV4_BATCHED, dispatch.NV4_MMA_GROUPED)}
    for fmt, (pairs, mma_path, fma_path, grouped) in paths.items():
        for tokens, want in {1: pairs, 2: pairs, 4: mma_path, 64: mma_path}.items():
            assert dispatch.heuristic(_dims(QWEN30, tokens), weight_format=fmt) == want, (fmt, tokens)
        assert dispatch.heuristic(Dims(1, 2048, 768, 512, 20), weight_format=fmt) == fma_path
        assert dispatch.heuristic(_dims(QWEN30, 1), dispatch.BATCH_INVARIANT, fmt) == pairs
        assert dispatch.heuristic(_dims(QWEN30, 64), dispatch.BATCH_INVARIANT, fmt) == grouped
        assert dispatch.choose(_dims(QWEN30, 8), "Fake GPU", tmp_path, weight_format=fmt) == (mma_path, "heuristic")
        assert dispatch.key_format(f"H2880-I2880-E128-K4-{fmt}") == fmt
        for name in (mma_path, pairs, grouped, fma_path, f"cupy:auto-{fmt}", f"cupy:auto-invariant-{fmt}"):
            assert get_variant(name).weight_format == fmt, name
