"""environment.yml and pyproject.toml name the same packages; README's test command is what CI runs; no torch."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$")


def _normalise(requirement: str) -> tuple[str, str]:
    match = NAME.match(requirement.strip())
    assert match, requirement
    return match.group(1).lower().replace("_", "-"), match.group(3).replace(" ", "")


def _conda_packages() -> dict[str, str]:
    packages = {}
    for line in (ROOT / "environment.yml").read_text().splitlines():
        item = re.match(r"^\s*-\s+([^#\s][^#]*)$", line)
        if not item or item.group(1).strip().startswith("pip:") or item.group(1).strip() == "pip":
            continue
        name, spec = _normalise(item.group(1))
        if name not in ("python", "conda-forge"):
            packages[name] = spec
    return packages


def _pyproject_packages() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    return dict(_normalise(r) for r in requirements)


def test_environment_yml_matches_pyproject() -> None:
    assert _conda_packages() == _pyproject_packages()


def test_cupy_from_one_channel_only() -> None:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    text = "\n".join(line.split("#")[0] for line in lines)
    conda_part, _, pip_part = text.partition("- pip:")
    assert "cupy" not in conda_part and "cupy-cuda12x" in pip_part
    assert "numba-cuda" in pip_part and "numba-cuda" not in conda_part


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^(python -m pip install .*)$", readme, re.MULTILINE)
    assert len(commands) >= 2, "README shows the run command and the test command"
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_no_torch_anywhere() -> None:
    for path in ROOT.rglob("*.py"):
        if ".venv" in path.parts:
            continue
        text = path.read_text()
        assert not re.search(r"^\s*(import torch|from torch)", text, re.MULTILINE), path
