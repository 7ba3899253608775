"""The layout: every folder is named as the package it installs (pyproject's `package-dir`), and the import graph
of all packages, function-level imports included, has only the edges of one table: `dspark_common` (the engine
format) and `dspark_calibration` (numpy statistics) import no other package, the torch-free runtime never the
exporter but once, where its command line builds an engine on first use (the demo's, or a model file's)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {name: ROOT / folder for name, folder in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items()}
ALLOWED_EDGES = {  # package -> the packages it may import
    "dspark_common": set(),
    "dspark_calibration": set(),
    "dspark_plugins": {"dspark_common"},
    "dspark_runtime": {"dspark_common", "dspark_calibration"},
    "dspark_export": {"dspark_common", "dspark_calibration", "dspark_plugins"},
}
ALLOWED_IMPORTS = {("dspark_runtime.cli", "dspark_export.cached_engines")}  # dspark-run builds on first use


def imports(package: str) -> set[tuple[str, str]]:
    """(module, imported module) for every absolute import in a package, function-level ones included."""
    found = set()
    for file in PACKAGES[package].rglob("*.py"):
        module = ".".join([package, *file.relative_to(PACKAGES[package]).with_suffix("").parts]).removesuffix(
            ".__init__")
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add((module, node.module))
            elif isinstance(node, ast.Import):
                found |= {(module, alias.name) for alias in node.names}
    return found


def test_every_folder_is_named_as_its_package():
    assert set(PACKAGES) == set(ALLOWED_EDGES)
    for package, folder in PACKAGES.items():
        assert folder.name == package and (folder / "__init__.py").is_file(), folder
    top_level = {path.parent.relative_to(ROOT).parts[0] for path in ROOT.glob("*/**/__init__.py")} - {"tests", "build"}
    assert top_level == {"dspark_export", "runtime", "plugins", "calibration"}  # no package outside the layout


def test_the_import_graph_has_only_the_allowed_edges():
    edges = {}
    for package in PACKAGES:
        for module, target in imports(package) - ALLOWED_IMPORTS:
            other = target.split(".")[0]
            if other in PACKAGES and other != package:
                edges.setdefault((package, other), module)
    unexpected = {edge: module for edge, module in edges.items() if edge[1] not in ALLOWED_EDGES[edge[0]]}
    assert not unexpected, f"imports outside the allowed edges (package pair: first module): {unexpected}"
    assert ("dspark_export", "dspark_common") in edges and ("dspark_runtime", "dspark_calibration") in edges  # seen


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
