"""Every script under scripts/ compiles and answers `--help`: a script that rots fails here, not in a reader's hands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_a_script_answers_help(script):
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in result.stdout.lower()


def test_the_gpu_check_finds_the_plugins_package():
    """gpu_check.sh puts plugins/ on the path: the package it imports from there is the one under plugins/."""
    root = SCRIPTS[0].parents[1]
    result = subprocess.run([sys.executable, "-c", "import dspark_plugins; print(dspark_plugins.__file__)"],
                            env={"PYTHONPATH": str(root / "plugins"), "PATH": ""}, capture_output=True, text=True,
                            cwd="/", timeout=60)
    assert result.returncode == 0 and "plugins/dspark_plugins/__init__.py" in result.stdout, result.stderr
    assert "$root/plugins" in (root / "scripts" / "gpu_check.sh").read_text()
