"""The README's IPython examples run as written (their CPU parts): the edit example really edits a kernel, and the
simulator route really runs the Numba kernels and matches the reference."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _block_after(marker: str) -> str:
    """The first ```python block after ``marker`` in the README, without its GPU-only ``bench.run`` lines."""
    text = (ROOT / "README.md").read_text()
    start = text.index(marker)
    code = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert code, f"no python block after {marker!r}"
    return "\n".join(line for line in code.group(1).splitlines() if "bench.run(" not in line)


def test_edit_example_changes_the_kernel() -> None:
    from kernels.compile import SOURCES
    from kernels.variants import load_builtin

    load_builtin()
    original = SOURCES["warp_decode_cupy"].code
    namespace: dict = {}
    try:
        exec(_block_after("**Edit a kernel and rerun.**"), namespace)  # noqa: S102 - the README's own example
        edited = SOURCES["warp_decode_cupy"].code
        from kernels.compile import offline_report

        after = {k.kernel: k.registers for k in offline_report(SOURCES["warp_decode_cupy"])}
    finally:
        SOURCES["warp_decode_cupy"].code = original
    before = {k.kernel: k.registers for k in offline_report(SOURCES["warp_decode_cupy"])}
    assert edited != original
    assert after["moe_gate_up_3d_batched"] <= 64 < before["moe_gate_up_3d_batched"]


@pytest.mark.slow
def test_simulator_example_runs_the_numba_kernels() -> None:
    code = _block_after("**Without a GPU**") + (
        "\nimport numpy as np\nfrom kernels.contract import BF16\n"
        "assert out.dtype == BF16 and np.isfinite(out.astype(np.float32)).all()\n"
        "assert np.abs(out.astype(np.float32) - ref.astype(np.float32)).max() < 1e-2\n"
        "print('simulated ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)  # a hang guard: ~10 s idle
    assert done.returncode == 0, done.stderr[-3000:]
    assert "simulated ok" in done.stdout


def _beside(tmp_path: Path, names: list[str], document: str, text: str) -> Path:
    """A copy of ``document`` under ``tmp_path`` at its place in the repository, the runs it names linked in at
    theirs: relative links (a report's runs and charts) come out as in the repository."""
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if not (tmp_path / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    copy = tmp_path / document
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_text(text)
    return copy


@pytest.mark.parametrize("document, option", [("README.md", "--headline"), ("results/REPORT.md", "--update-readme")])
def test_tables_are_generated_from_committed_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, document: str,
                                                  option: str) -> None:
    """Every number in the README's headline and in results/REPORT.md comes from the committed JSON through
    tools.report, by the command the document itself names: regenerating changes nothing."""
    from tools import report

    text = (ROOT / document).read_text()
    names = report.named_runs(text, option, document)
    assert names and all((ROOT / name).is_file() for name in names), names
    copy = _beside(tmp_path, names, document, text)
    monkeypatch.chdir(tmp_path)
    assert report.main([*names, option, document]) == 0
    assert copy.read_text() == text


def test_report_accuracy_block_is_generated_by_the_command_it_names(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """results/REPORT.md's accuracy tables come from the committed JSON through the tools.accuracy command the
    document names: regenerating changes nothing."""
    from tools import accuracy

    document = "results/REPORT.md"
    text = (ROOT / document).read_text()
    command = re.search(r"`python -m tools\.accuracy ([^`]+?) --update-readme results/REPORT\.md`", text)
    assert command, "results/REPORT.md names no tools.accuracy command"
    argv = command.group(1).split()
    names = [arg for arg in argv if arg.endswith(".json")]
    assert names and all((ROOT / name).is_file() for name in names), names
    copy = _beside(tmp_path, names, document, text)
    monkeypatch.chdir(tmp_path)
    assert accuracy.main([*argv, "--update-readme", document]) == 0
    assert copy.read_text() == text


def test_report_decode_block_is_generated_by_the_command_it_names() -> None:
    """results/REPORT.md's decode-step tables are what the tools.decode command it names prints for its run."""
    from tools import decode

    text = (ROOT / "results/REPORT.md").read_text()
    command = re.search(r"`python -m tools\.decode --markdown (\S+\.json)`", text)
    assert command, "results/REPORT.md names no tools.decode --markdown command"
    block = text.split("<!-- decode:begin -->\n", 1)[1].split("<!-- decode:end -->", 1)[0]
    assert block == decode.markdown(json.loads((ROOT / command.group(1)).read_text()))
