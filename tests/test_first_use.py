"""A user's own model in one command, as llama.cpp runs a file: `dspark-run FILE.gguf` builds an engine on first use
(torch not needed), finds the drafter trained for it or says plainly there is none, and reuses the engine after; a
wrong path, a busy port or an impossible mode is one line naming the next step."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

gguf = pytest.importorskip("gguf")

from dspark_export.presets import demo_dir  # noqa: E402
from dspark_runtime.chat import ChatSession  # noqa: E402
from dspark_runtime.engine import Engine  # noqa: E402
from dspark_common.sampling import SamplingParams  # noqa: E402
from tests.gguf_files import write_gguf  # noqa: E402

QUESTION = "A train travels 60 km each hour. How far does it travel in 4 hours?"
NO_TORCH = """import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
sys.meta_path.insert(0, NoTorch())
"""


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A fresh DSPARK_HOME, a Q4_0 file of the demo target (as llama-quantize writes one), and a Python that
    cannot import torch."""
    root = tmp_path_factory.mktemp("first-use")
    (root / "no-torch").mkdir()
    (root / "no-torch" / "sitecustomize.py").write_text(NO_TORCH)
    file = write_gguf(demo_dir(), root / "my-model.Q4_0.gguf", "Q4_0", embedding_type="Q8_0")
    return root, file


def run(home, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    root, _ = home
    env = os.environ | {"DSPARK_HOME": str(root / "dspark"), "PYTHONPATH": str(root / "no-torch")}
    command = [sys.executable, "-c", "from dspark_runtime.cli import main; main()", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def test_a_gguf_file_answers_in_one_command_without_torch(home):
    _, file = home
    first = run(home, str(file), "-p", QUESTION, "-n", "32", "--temp", "0")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip()
    assert "building an engine of" in first.stderr and "drafter demo-dspark" in first.stderr  # found for this target
    again = run(home, str(file), "--drafter", "demo-dspark", "-p", QUESTION, "-n", "32", "--temp", "0")
    assert again.returncode == 0 and "building" not in again.stderr  # built once, reused
    assert again.stdout == first.stdout


def test_inspect_reads_a_gguf_without_torch(home):
    root, file = home
    env = os.environ | {"PYTHONPATH": str(root / "no-torch")}
    result = subprocess.run([sys.executable, "-c", "from dspark_export.cli import main; main()", "inspect", str(file)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "mostly Q4_0" in result.stdout


def test_a_model_without_a_fitting_drafter_decodes_plainly_and_says_so(home, tmp_path):
    from dspark_export.demo.tokenizer import train_tokenizer
    from tests.conftest import write_hf_checkpoint

    other = write_hf_checkpoint(tmp_path / "other", vocab_size=300, max_position_embeddings=64)
    train_tokenizer(["a small text for a small tokenizer"] * 4, other, vocab_size=300)
    file = write_gguf(other, tmp_path / "other.gguf", "Q8_0")
    result = run(home, str(file), "-p", "a small", "-n", "4")
    assert result.returncode == 0, result.stderr
    assert "no drafter fits this target, so plain decoding" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["/no/such/model.gguf", "-p", "hi"], "does not exist; give an engine folder, a GGUF file"),
    (["serve", "--port", "{port}"], "is in use (another server?); choose another with --port"),
    (["--spec", "fixed:99", "-p", "hi"], "fixed:99 asks for more drafts than this engine's drafter makes"),
])
def test_a_wrong_start_is_one_line_naming_the_next_step(home, args, message):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run(home, *[a.format(port=port) for a in args], timeout=120)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr and "http://" not in result.stderr + result.stdout


def test_an_interrupted_reply_stays_out_of_the_history(home, monkeypatch):
    from dspark_export.cached_engines import model_engine

    root, file = home
    monkeypatch.setenv("DSPARK_HOME", str(root / "dspark"))
    with Engine.load(model_engine(str(file)), profile=False) as engine:
        session = ChatSession(engine, SamplingParams(max_tokens=64, temperature=0.0))
        reply = session.send(QUESTION)
        next(reply)
        reply.close()  # what Ctrl+C does to the stream
        assert session.history == [] and session.last.finish_reason == "cancelled"
        assert "".join(d.text for d in session.send(QUESTION)) and len(session.history) == 2
