"""Every model file is checked before it is trusted: broken and hostile variants of a GGUF file (the classes of
`tests.gguf_fuzz`) fail `inspect` and `build` in one line of ours, fast, within 2 GiB, with nothing written; chat
templates render within bounds, their failures one error for that request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

gguf = pytest.importorskip("gguf")

from click.testing import CliRunner  # noqa: E402

from dspark_common.errors import TokenizerError  # noqa: E402
from dspark_common.tokenizer import ChatTokenizer  # noqa: E402
from dspark_export.cli import main as export_main  # noqa: E402
from dspark_export.presets import demo_dir  # noqa: E402
from tests.gguf_files import write_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory):
    return write_gguf(demo_dir(), tmp_path_factory.mktemp("fuzz") / "demo-Q4_0.gguf", "Q4_0", embedding_type="Q8_0")


def test_every_broken_variant_fails_in_one_line_within_bounds(valid_file, tmp_path):
    result = subprocess.run([sys.executable, "-m", "tests.gguf_fuzz", str(valid_file), str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(runs) >= 100  # 50+ variants, inspect and build each
    wrong = [(r["mutant"], r["command"], r["code"], r["crash"], r["output"][-300:]) for r in runs
             if r["code"] != 1 or r["crash"] or r["wrote"] or r["seconds"] > 20
             or len(r["output"].strip().splitlines()) != 1 or not r["output"].startswith("Error: ")]
    assert wrong == []


def test_the_valid_file_and_odd_paths(valid_file, tmp_path):
    """The unbroken file still builds; an empty file and a link to itself fail in one line."""
    built = CliRunner().invoke(export_main, ["build", "--target-path", str(valid_file), "--no-drafter", "--out",
                                             str(tmp_path / "engine")])
    assert built.exit_code == 0, built.output
    (tmp_path / "empty.gguf").write_bytes(b"")
    os.symlink(tmp_path / "loop.gguf", tmp_path / "loop.gguf")
    for name in ("empty.gguf", "loop.gguf"):
        result = CliRunner().invoke(export_main, ["inspect", str(tmp_path / name)])
        assert result.exit_code == 1 and result.output.startswith("Error: ") and result.exception is not None
        assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("template, message", [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ raise_exception() }}", "raise_exception() was called"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ 'x' * 6000000000 }}", "a str repeated 6000000000 times"),
    ("{{ ([1] * 100000000) | length }}", "a list repeated"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loops over more than"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "a value of"),
    ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "a value of"),
    ("{{ messages | tojson(indent=1000000000) }}", "a width of"),
    ("{{ 'a' | center(10000000000) }}", "a width of"),
    ("{{ '%10000000000s' % 'a' }}", "a width of"),
    ("{{ '{:>10000000000}'.format('a') }}", "a width of"),
    ("{{ 2 ** 100000000 }}", "an exponent of"),
    ("{% for i in range(5000) %}{{ 'y' * 1000 }}{% endfor %}", "characters written"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
])
def test_a_hostile_chat_template_is_one_error_within_bounds(template, message):
    from tokenizers import Tokenizer, models

    tokenizer = ChatTokenizer(Tokenizer(models.BPE()), template)
    started = time.perf_counter()
    with pytest.raises(TokenizerError, match="chat template") as raised:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert message in str(raised.value) and time.perf_counter() - started < 5
    tokenizer.chat_template = "{% for m in messages %}{{ m.content ~ '!' }}{{ '%s' % 'a' }}{% endfor %}"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!a"


def test_a_file_whose_template_fails_answers_in_one_line_and_completion_still_runs(tmp_path):
    """A GGUF whose chat template raises: a chat turn is one error naming the template; plain completion runs."""
    folder = tmp_path / "model"
    folder.mkdir()
    for source in demo_dir().iterdir():
        (folder / source.name).symlink_to(source)
    config = json.loads((demo_dir() / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": "{{ raise_exception() }}"}))
    file = write_gguf(folder, tmp_path / "hostile.gguf", "Q8_0")
    env = os.environ | {"DSPARK_HOME": str(tmp_path / "home")}
    # seeded: unseeded, the completion's first draw was now and then the end token (1 run in about 25)
    command = [sys.executable, "-m", "dspark_runtime.cli", str(file), "-n", "4", "-p", "hi", "--seed", "0"]
    chat = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in chat.stderr.splitlines() if line.startswith("Error:")]
    assert chat.returncode == 1 and len(errors) == 1 and "chat template failed" in errors[0], chat.stderr
    assert "Traceback" not in chat.stderr
    completion = subprocess.run([*command, "--completion"], env=env, capture_output=True, text=True, timeout=300)
    assert completion.returncode == 0 and completion.stdout.strip(), completion.stderr
