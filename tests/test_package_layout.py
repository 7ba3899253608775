"""The import graph: the exporter and the runtime share only `dspark_common`, which imports neither; the runtime
reaches the exporter once, where its command line builds the bundled demo on first use."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"dspark_common": ROOT / "common", "dspark_runtime": ROOT / "runtime",
            "dspark_export": ROOT / "dspark_export"}
ALLOWED = {("dspark_runtime.cli", "dspark_export.demo.engine")}  # dspark-run's first use builds the demo


def imports(package: str) -> set[tuple[str, str]]:
    """(module, imported module) for every import in a package, function-level ones included."""
    found = set()
    for file in PACKAGES[package].rglob("*.py"):
        module = ".".join([package, *file.relative_to(PACKAGES[package]).with_suffix("").parts]).removesuffix(
            ".__init__")
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add((module, node.module))
            elif isinstance(node, ast.Import):
                found |= {(module, alias.name) for alias in node.names}
    return found


def crossing(package: str, others: tuple[str, ...]) -> set[tuple[str, str]]:
    return {(m, target) for m, target in imports(package) if target.split(".")[0] in others} - ALLOWED


def test_the_exporter_and_the_runtime_share_only_dspark_common():
    assert crossing("dspark_common", ("dspark_runtime", "dspark_export")) == set()
    assert crossing("dspark_export", ("dspark_runtime",)) == set()
    assert crossing("dspark_runtime", ("dspark_export",)) == set()
    assert ("dspark_export.graphs.target", "dspark_common.graph_io") in imports("dspark_export")  # the check sees



@pytest.mark.parametrize("package, command", [("dspark_runtime", "dspark-run"), ("dspark_export", "dspark-export")])
def test_packages_run_as_their_commands(package, command):
    out = subprocess.run([sys.executable, "-m", package, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and f"Usage: {command}" in out.stdout, out


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_the_tensorrt_plugin_names_its_extra_when_tensorrt_is_missing():
    from dspark_common.errors import MissingDependencyError
    from dspark_plugins.trt_plugin import register_plugin

    with pytest.raises(MissingDependencyError, match=r"dspark\[trt\]"):
        register_plugin()
