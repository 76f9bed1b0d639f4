"""The tree is ruff clean (pyproject.toml holds the rules)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_clean() -> None:
    if (
        shutil.which("ruff") is None
        and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode
    ):
        pytest.skip("needs ruff (pip install '.[test]')")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
        timeout=300,  # a hang guard: well under a second on 2 idle cores
    )
    assert result.returncode == 0, result.stdout + result.stderr
