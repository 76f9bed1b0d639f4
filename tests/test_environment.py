"""environment.yml and pyproject.toml name the same packages; README's test command is what CI runs; no torch."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)$")

# PyPI name -> the conda-forge package that environment.yml must name, for everything installed from conda-forge.
# Each is the conda-forge feedstock's package name: https://github.com/conda-forge/ml_dtypes-feedstock publishes
# ml-dtypes as `ml_dtypes`; https://github.com/conda-forge/matplotlib-feedstock publishes `matplotlib-base`, the
# library without a GUI toolkit (its `matplotlib` adds Qt: the plots here draw headless); numpy, rich, pytest,
# pytest-xdist and ruff are published under their PyPI names
# (https://github.com/conda-forge/{numpy,rich,pytest,pytest-xdist,ruff}-feedstock).
CONDA_FORGE_NAMES = {
    "numpy": "numpy",
    "ml-dtypes": "ml_dtypes",
    "rich": "rich",
    "matplotlib": "matplotlib-base",
    "pytest": "pytest",
    "pytest-xdist": "pytest-xdist",
    "ruff": "ruff",
}


def _split(requirement: str) -> tuple[str, str]:
    """``(name exactly as written, version specifier without spaces)``."""
    match = NAME.match(requirement.strip())
    assert match, requirement
    return match.group(1), match.group(3).replace(" ", "")


def _conda_packages(text: str) -> dict[str, str]:
    """The conda (not pip) dependencies of an environment.yml text, names as written; python and pip left out."""
    packages = {}
    conda_part = text.split("- pip:")[0]
    in_dependencies = False
    for line in conda_part.splitlines():
        if re.match(r"^\S", line):
            in_dependencies = line.startswith("dependencies:")
            continue
        item = re.match(r"^\s*-\s+([^#\s][^#]*)$", line)
        if not in_dependencies or not item:
            continue
        name, spec = _split(item.group(1))
        if name not in ("python", "pip"):
            packages[name] = spec
    return packages


def _pip_packages(text: str) -> dict[str, str]:
    """The packages under environment.yml's ``- pip:`` list (PyPI names, as written)."""
    _, _, pip_part = text.partition("- pip:")
    return dict(_split(m) for m in re.findall(r"^[ \t]*-[ \t]+([^#\s][^#\n]*)$", pip_part, re.MULTILINE))


def _pyproject_packages() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["test"]
    return dict(_split(r) for r in requirements)


def _expected_conda(pyproject: dict[str, str], pip_names: Iterable[str]) -> dict[str, str]:
    """What environment.yml's conda part must say: every pyproject dependency not installed by pip, under its
    conda-forge name (a KeyError names a dependency whose conda-forge name is not recorded above)."""
    pip_names = {name.lower() for name in pip_names}
    return {CONDA_FORGE_NAMES[name]: spec for name, spec in pyproject.items() if name.lower() not in pip_names}


def test_environment_yml_matches_pyproject() -> None:
    text = (ROOT / "environment.yml").read_text()
    pyproject = _pyproject_packages()
    pip = _pip_packages(text)
    assert pip == {name: pyproject.get(name) for name in pip}, "pip packages: pyproject's names and versions"
    assert _conda_packages(text) == _expected_conda(pyproject, pip)


@pytest.mark.parametrize("wrong", ["ml-dtypes", "ML_dtypes"])
def test_conda_names_are_compared_exactly(wrong: str) -> None:
    """A conda dependency spelled the PyPI way ('-' where conda-forge uses '_'), or in another case, is caught."""
    text = (ROOT / "environment.yml").read_text()
    broken = re.sub(r"^(\s*-\s+)ml_dtypes(?=[<>=!~\s]|$)", rf"\g<1>{wrong}", text, count=1, flags=re.M)
    assert broken != text
    pyproject = _pyproject_packages()
    pip_names = _pip_packages(broken)
    assert _conda_packages(broken) != _expected_conda(pyproject, pip_names)


def test_conda_forge_names_cover_the_conda_dependencies() -> None:
    pip_names = {name.lower() for name in _pip_packages((ROOT / "environment.yml").read_text())}
    assert {name for name in _pyproject_packages() if name.lower() not in pip_names} == set(CONDA_FORGE_NAMES)


def test_cupy_from_one_channel_only() -> None:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    text = "\n".join(line.split("#")[0] for line in lines)
    conda_part, _, pip_part = text.partition("- pip:")
    assert "cupy" not in conda_part and "cupy-cuda12x" in pip_part
    assert "numba-cuda" in pip_part and "numba" not in conda_part
    assert "numba" in _pip_packages("\n".join(lines))  # numba itself too, as the header comment says
    header = "\n".join(line for line in lines if line.startswith("#"))
    assert all(name in header for name in ("CuPy", "Numba", "numba-cuda")), "the comment names the pip packages"


def test_numpy_bounded_below_what_numba_and_cupy_support() -> None:
    """numba and cupy need numpy < 2.6: both files bound it the same way (2.x up to 2.5, nothing from 2.6)."""
    from packaging.specifiers import SpecifierSet

    text = (ROOT / "environment.yml").read_text()
    spec = _pyproject_packages()["numpy"]
    assert _conda_packages(text)["numpy"] == spec
    allowed = SpecifierSet(spec)
    assert {v for v in ("1.26.4", "2.0.0", "2.5.2", "2.6.0", "3.0.0") if v in allowed} == {"2.0.0", "2.5.2"}


def test_readme_test_command_is_what_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^(python -m pip install .*)$", readme, re.MULTILINE)
    assert len(commands) >= 2, "README shows the run command and the test command"
    test_command = next(c for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_no_torch_outside_the_peers() -> None:
    """The lab is PyTorch-free: torch and triton are imported only by tools/peers (the optional peers extra), which
    nothing else imports, and the project's dependencies do not name them."""
    peers = ROOT / "tools" / "peers"
    for path in ROOT.rglob("*.py"):
        if ".venv" in path.parts or peers in path.parents:
            continue
        text = path.read_text()
        assert not re.search(r"^\s*(import (torch|triton)|from (torch|triton))", text, re.MULTILINE), path
        if path.parent != ROOT / "tests":
            assert not re.search(r"^\s*(import tools\.peers|from tools\.peers|from tools import peers)", text,
                                 re.MULTILINE), path
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.split()[0].lower().startswith(("torch", "triton"))]
    assert project["optional-dependencies"]["peers"] == ["torch", "triton"]


# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt (11358 bytes, the appendix's placeholder unfilled)
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def test_license_file_is_the_license_declared() -> None:
    """pyproject.toml declares Apache-2.0 and LICENSE is its standard text, unmodified (no added terms)."""
    import hashlib

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_bytes()
    assert text.decode("ascii").lstrip().startswith("Apache License\n                           Version 2.0")
    assert hashlib.sha256(text).hexdigest() == APACHE_2_0_SHA256
