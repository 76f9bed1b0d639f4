"""Every ``python -m tools.X`` program refuses an unknown option, and a bad value, with exit 2 and one line naming it.

All in-process (``main(argv)``), nothing measured: fast anywhere.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tools import bench, roofline, sweep

CLIS = ("tools.roofline", "tools.sweep", "tools.accuracy", "tools.report", "tools.dispatch_table", "tools.decode",
        "tools.peers.decode")


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _exit_2(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``main(argv)``, which must exit 2; returns the last non-empty line of stderr (argparse's message)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return _last_line(err)


@pytest.mark.parametrize("name", CLIS)
def test_unknown_option_exits_2_naming_it(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _exit_2(importlib.import_module(name).main, ["--bogus"], capsys)
    assert "unrecognized arguments: --bogus" in line, line


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """A missing file, a JSON list, a sweep record and a bench run made without a GPU (checks, no timing): none of
    them is what the tools below can use."""
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "sweep.json").write_text(json.dumps({"schema": "warp-decode-sweep/1", "points": []}))
    (tmp_path / "cpu_run.json").write_text(json.dumps({
        "schema": bench.SCHEMA, "environment": {"gpu": None, "date": "2026-12-05T00:00:00+00:00"},
        "config": {"models": ["qwen3-30b-a3b"], "batches": [1], "routing": "uniform"}, "rooflines": None,
        "results": [], "cpu": {"reason": "no CUDA driver"}}))
    return {"missing": str(tmp_path / "missing.json"), "list": str(tmp_path / "list.json"),
            "sweep": str(tmp_path / "sweep.json"), "cpu_run": str(tmp_path / "cpu_run.json"),
            "table": str(tmp_path / "table.json")}


@pytest.mark.parametrize(
    "name, argv, message",
    [
        ("tools.roofline", ["--repeats", "0"], "argument --repeats: expected an int >= 1, got 0"),
        ("tools.sweep", [], "the following arguments are required: VARIANT"),
        ("tools.sweep", ["cupy:warp-decode", "--model", "nope"], "--model: unknown preset 'nope'"),
        ("tools.sweep", ["cupy:warp-decode", "--seed", "-1"], "--seed must be an int >= 0, got -1"),
        ("tools.sweep", ["cupy:warp-decode", "--grid", "WARPS"], "--grid takes KEY=v1,v2"),
        ("tools.sweep", ["cupy:warp-decode", "--grid", "DN_SLOTS=2,,4"], "--grid DN_SLOTS: an empty value in '2,,4'"),
        ("tools.sweep", ["cupy:warp-decode", "--batch", "1,,8"],
         "argument --batch: expected a comma list of ints like 1,2,4, got '1,,8' (item 2 is empty)"),
        ("tools.sweep", ["cupy:warp-decode", "--batch", "1,8,"], "got '1,8,' (item 3 is empty)"),
        ("tools.sweep", ["cupy:warp-decode", "--batch", "1,eight"], "got '1,eight' ('eight' is not an int)"),
        ("tools.sweep", ["cupy:warp-decode", "--batch", "8,0"], "argument --batch: batch sizes must be ints >= 1"),
        ("tools.sweep", ["--list", "cupy:warp-decode"], "--list lists every variant: leave VARIANT out"),
        ("tools.peers.__main__", ["--model", "nope"], "--model: unknown preset(s) 'nope'; known: qwen3-30b-a3b"),
        ("tools.peers.__main__", ["--model", "tiny,qwen9"], "--model: unknown preset(s) 'qwen9'"),
        ("tools.peers.__main__", ["--batch", "1,,8"], "argument --batch: expected a comma list of ints"),
        ("tools.peers.__main__", ["--batch", "-1"], "argument --batch: batch sizes must be ints >= 1"),
        ("tools.peers.__main__", ["--repeats", "0"], "argument --repeats: expected an int >= 1, got 0"),
        ("tools.peers.__main__", ["--configs", "M99"], "--configs: triton:fused-moe has no tile config 'M99'"),
        ("tools.peers.__main__", ["--weight-format", "fp8-block128", "--configs", "0,5"],
         "--configs: triton:fused-moe-w8a8 has no tile config '5'"),
        ("tools.peers.__main__", ["--weight-format", "mxfp4", "--configs", "0,7"],
         "--configs: triton:fused-moe-w4a16 has no tile config '7'"),
        ("tools.peers.__main__", ["--configs", "0", "--tune"], "--tune picks the fastest of every tile config"),
        ("tools.report", [], "the following arguments are required: JSON"),
        ("tools.report", ["{missing}"], "cannot read"),
        ("tools.report", ["{list}"], "is a JSON list, not a tools.bench result"),
        ("tools.report", ["{sweep}"], "is a 'warp-decode-sweep/1' record, not a tools.bench result"),
        ("tools.dispatch_table", [], "the following arguments are required: --json"),
        ("tools.dispatch_table", ["--json", "{table}", "--model", "qwen9"], "--model: unknown preset(s) 'qwen9'"),
        ("tools.dispatch_table", ["--json", "{table}", "--repeats", "0"], "argument --repeats: expected an int >= 1"),
        ("tools.dispatch_table", ["--json", "{table}", "--batch", "1,x"], "argument --batch: expected a comma list"),
        ("tools.dispatch_table", ["--json", "{table}", "--from-bench", "{missing}"], "--from-bench: [Errno 2]"),
        ("tools.dispatch_table", ["--json", "{table}", "--from-bench", "{sweep}"],
         "--from-bench: not a tools.bench result"),
        ("tools.dispatch_table", ["--json", "{table}", "--from-bench", "{cpu_run}"],
         "--from-bench: cpu_run.json took no timing (run without a GPU: no CUDA driver); a dispatch table needs a "
         "tools.bench run on the GPU it describes"),
        ("tools.dispatch_table", ["--json", "{table}", "--batch", "1,,8"], "argument --batch: expected a comma list"),
        ("tools.accuracy", ["--model", "qwen9"], "--model: unknown model 'qwen9'"),
        ("tools.accuracy", ["--paths", "nope"], "--paths: unknown path 'nope'"),
        ("tools.accuracy", ["--depth-from", "{list}"], "--depth-from goes with --markdown-from"),
        ("tools.accuracy", ["--markdown-from", "{missing}"], "--markdown-from: cannot read"),
        ("tools.accuracy", ["--markdown-from", "{sweep}"], "is not a result of python -m tools.accuracy --json"),
    ],
)
def test_bad_values_exit_2_with_one_line(name: str, argv: list[str], message: str, files: dict[str, str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    line = _exit_2(importlib.import_module(name).main, [a.format(**files) for a in argv], capsys)
    assert message in line, line
    assert not Path(files["table"]).exists()


# -- the sweep's --grid knobs ----------------------------------------------------------------------------------
class _Reached(Exception):
    """Raised by the stand-in sweep(): the arguments passed every check."""


@pytest.fixture
def stub_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """No simulator switch (it sets a process-wide variable), and sweep() itself stops at once with its grid."""
    monkeypatch.setattr(bench, "_enable_simulator", lambda: None)

    def reached(name: str, model: str, batch: list[int], grid: dict[str, list[Any]], *rest: Any, **more: Any) -> None:
        raise _Reached(name, grid)

    monkeypatch.setattr(sweep, "sweep", reached)


def _knobs_variant() -> Any:
    from kernels.variants import Variant

    def build(dims: Any, WARPS: int = 4, **params: Any) -> Any:  # noqa: N803 - knob names are CUDA macros
        raise AssertionError("never built")

    return Variant(name="fake:knobs", backend="cupy", family="fake", build=build, params={"UNROLL": 1},
                   grid={"SLOTS": [2, 4]})


def test_sweep_unknown_knob_exits_2(monkeypatch: pytest.MonkeyPatch, stub_sweep: None,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    variant = _knobs_variant()
    monkeypatch.setattr(sweep, "load_registry", lambda: ({variant.name: variant}, []))
    line = _exit_2(sweep.main, ["fake:knobs", "--grid", "NOPE=1,2", "--grid", "SLOTS=2", "--grid", "ALSO=3"], capsys)
    assert line.endswith("error: --grid: unknown knob(s) ALSO, NOPE for fake:knobs; known: SLOTS, UNROLL, WARPS"), line
    # params, grid keys and build()'s named keywords are all knobs
    with pytest.raises(_Reached) as reached:
        sweep.main(["fake:knobs", "--grid", "SLOTS=2,4", "--grid", "UNROLL=1", "--grid", "WARPS=4,8"])
    assert reached.value.args == ("fake:knobs", {"SLOTS": [2, 4], "UNROLL": [1], "WARPS": [4, 8]})


def test_sweep_knobs_of_registered_variants(stub_sweep: None, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's sweep passes; a typo of one of its knobs does not; a knob-less variant takes none."""
    with pytest.raises(_Reached):
        sweep.main(["cupy:warp-decode", "--batch", "1,8", "--grid", "DN_SLOTS=2,4", "--grid", "DN_UNROLL=1,3"])
    line = _exit_2(sweep.main, ["cupy:warp-decode", "--grid", "DN_SLOT=2,4"], capsys)
    assert "unknown knob(s) DN_SLOT for cupy:warp-decode; known: DN_BYTES" in line and "DN_SLOTS" in line, line
    line = _exit_2(sweep.main, ["cupy:auto", "--grid", "DN_SLOTS=2"], capsys)
    assert line.endswith("known: none (it takes no knobs)"), line
    registry, _ = bench.load_registry()
    for variant in registry.values():  # every variant's own grid is made of knobs it knows
        assert set(variant.grid) <= sweep.known_knobs(variant), variant.name


def test_sweep_refuses_knob_values_outside_the_family_limits(stub_sweep: None,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A --grid value its kernel family cannot take (not an int, out of its limits) exits 2 naming the knob, the value
    and what is allowed -- before anything is compiled or timed (the stand-in sweep() is never reached)."""
    registry, _ = bench.load_registry()
    family = registry["cupy:warp-decode"].kernel_family
    low, high = family.limits["DN_SLOTS"]
    allowed = f"cupy:warp-decode takes DN_SLOTS as an int in {low}..{high} (0 = auto)"
    for value, problem in (("abc", "'abc' is not an int"), (str(high + 1), f"{high + 1} is out of range"),
                           ("999999", "999999 is out of range"), ("2.5", "2.5 is not an int"),
                           ("true", "True is not an int")):
        line = _exit_2(sweep.main, ["cupy:warp-decode", "--grid", f"DN_SLOTS=2,{value}"], capsys)
        assert line.endswith(f"error: --grid DN_SLOTS: {problem}; {allowed}"), line
    with pytest.raises(_Reached):  # the limits themselves pass
        sweep.main(["cupy:warp-decode", "--grid", f"DN_SLOTS={low},{high}"])


def test_sweep_function_checks_the_grid_before_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """sweep() itself (the Python entry point) refuses the same values with a ValueError, before any compile."""
    monkeypatch.setattr(bench, "_enable_simulator", lambda: None)
    monkeypatch.setattr(sweep, "_all_compile_columns", lambda *args: pytest.fail("compiled a refused grid"))
    with pytest.raises(ValueError, match=r"--grid DN_SLOTS: 999999 is out of range; cupy:warp-decode takes"):
        sweep.sweep("cupy:warp-decode", "tiny", [1], {"DN_SLOTS": [999999]}, progress=False)
    assert sweep.grid_error(_knobs_variant(), {"SLOTS": ["x"]}) is None  # no family: build() judges its knobs


def test_sweep_lists_the_variants(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--list prints every registered variant with the first line of its description and exits 0 (no GPU needed)."""
    monkeypatch.setattr(bench, "_enable_simulator", lambda: None)
    assert sweep.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    registry, _ = bench.load_registry()
    assert [line.split()[0] for line in lines] == list(registry)
    strict = registry["cupy:warp-decode"]
    assert next(line for line in lines if line.startswith("cupy:warp-decode ")).endswith(strict.description)


# -- every CLI's --help: each option says what it does and its default, and the help ends in examples ----------------
HELP_CLIS = ("tools.accuracy", "tools.bench", "tools.compile_report", "tools.cpu_timings", "tools.decode",
             "tools.dispatch_table", "tools.multi", "tools.peers.__main__", "tools.precompile", "tools.report",
             "tools.roofline", "tools.sass_hashes", "tools.sweep")


class _Parser(Exception):
    """Raised by the stand-in parse_args: carries the parser a CLI built."""


def _parser_of(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    import argparse

    def caught(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        raise _Parser(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(_Parser) as parsed:
        importlib.import_module(name).main([])
    return parsed.value.args[0]


def test_every_cli_is_in_the_help_checks() -> None:
    """Each ``python -m tools.X`` program (but the harness, which takes no option)."""
    tools_dir = Path(__file__).resolve().parents[1] / "tools"
    mains = {f"tools.{path.stem}" for path in tools_dir.glob("*.py") if "def main(" in path.read_text()}
    assert mains - {"tools.harness"} | {"tools.peers.__main__"} == set(HELP_CLIS)


@pytest.mark.parametrize("name", HELP_CLIS)
def test_every_option_has_help_with_its_default(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    parser = _parser_of(name, monkeypatch)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help.strip(), (name, action.dest)
        if action.option_strings and action.nargs != 0:  # an option that takes a value says what it is by default
            assert "default" in action.help or "required" in action.help, (name, action.option_strings)
    assert parser.formatter_class is argparse.RawDescriptionHelpFormatter, name
    examples = parser.epilog.splitlines()
    prog = "python -m " + name.removesuffix(".__main__")
    assert examples[0] == "examples:" and 2 <= len(examples) - 1 <= 4, (name, examples)
    assert all(line.startswith(f"  {prog} ") or line == f"  {prog}" for line in examples[1:]), (name, examples)


@pytest.mark.parametrize("name", HELP_CLIS)
def test_help_prints_the_examples(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(name).main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "\nexamples:\n  python -m tools." in out and "(default" in out, out[-500:]


# -- roofline ----------------------------------------------------------------------------------------------------
@pytest.mark.cpu_only
def test_roofline_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert roofline.main([]) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    assert out.startswith("no CUDA GPU (") and out.rstrip().endswith("): no roofline measured"), out


def test_roofline_prints_and_writes_what_measure_returns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    record = {"datasheet_tbps": 4.8, "read_tbps": 4.32, "read_best_tbps": 4.41, "d2d_memcpy_tbps": 3.6,
              "copy16_tbps": 3.84}
    seen = []
    monkeypatch.setattr(roofline, "gpu_available", lambda: (True, "1 device(s)"))
    monkeypatch.setattr(roofline, "measure", lambda repeats: seen.append(repeats) or dict(record))
    monkeypatch.setattr(roofline, "_gpu_name", lambda: "NVIDIA H200")
    path = tmp_path / "out" / "roof.json"
    assert roofline.main(["--repeats", "3", "--json", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert seen == [3]
    assert out[0] == "rooflines on NVIDIA H200 (datasheet 4.80 TB/s)"
    assert out[1].split()[:3] == ["read", "4.32", "TB/s"] and "90%" in out[1] and "best 4.41 TB/s" in out[1]
    assert out[2].split()[:3] == ["d2d_memcpy", "3.60", "TB/s"] and "75%" in out[2]
    assert out[3].split()[:3] == ["copy16", "3.84", "TB/s"] and "80%" in out[3]
    assert json.loads(path.read_text()) == {"gpu": "NVIDIA H200", **record}


@pytest.mark.parametrize("argv", [["jobs=0"], ["report=2"], ["nonsense=1"]])
def test_gpu_check_rejects_bad_arguments(tmp_path: Path, argv: list[str]) -> None:
    """tools/gpu_check.sh: a bad value or an unknown argument exits 2 before it runs anything."""
    import subprocess

    done = subprocess.run(["bash", "tools/gpu_check.sh", *argv], env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_gpu_check_deals_test_ids_to_its_processes(tmp_path: Path) -> None:
    """jobs=N collects the selected GPU tests (-m gpu and k=) and deals their ids round-robin, so one file's tests
    spread over the processes; every id runs once (here they skip: no GPU); their logs end in one file."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "tools/gpu_check.sh", "tests=tests/test_warp_decode_fp8.py", "k=not zipf",
                           "jobs=3", "report=0", "tests_s=200"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ids = (tmp_path / "gpu-test-ids.txt").read_text().split()
    assert len(ids) > 3 and not any("zipf" in i for i in ids)
    joined = (tmp_path / "gpu-tests.log").read_text()
    sections = [part.strip().splitlines() for part in re.split(r"^== gpu-tests-\d+\.log$", joined, flags=re.M)[1:]]
    assert len(sections) == 3 and not list(tmp_path.glob("gpu-tests-[0-9]*.log"))  # one log, a section a process
    ran = sum(int(lines[-1].split()[0]) for lines in sections)  # "N skipped in ..."
    assert ran == len(ids) and f"{len(ids)} tests selected, dealt to 3 processes" in done.stdout


def test_sweep_record_dates_itself_at_the_top(tmp_path: Path) -> None:
    """A sweep's JSON carries its date at the top, as the bench's does (and in its environment). In a process of its
    own: a sweep without a GPU switches Numba to its simulator, which the process keeps."""
    import subprocess
    import sys

    path = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, "-m", "tools.sweep", "cupy:warp-decode", "--model", "tiny", "--batch", "1",
                           "--grid", "DN_SLOTS=1", "--json", str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads(path.read_text())
    assert record["date"] == record["environment"]["date"] and record["date"].startswith("20")
