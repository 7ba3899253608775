"""`dspark-run` chat driven through a pseudo-terminal: streamed answers, Ctrl+C keeps the session, /exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")
pytest.importorskip("torch")

from tests.conftest import build_echo_engine  # noqa: E402


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    folder = build_echo_engine(tmp_path_factory.mktemp("chat"), context=32768, flat_curve=True)
    return folder


def dspark_run(*args: str) -> list[str]:
    return [sys.executable, "-c", "from dspark_runtime.cli import main; main()", *args]


def test_interactive_chat(engine_dir):
    """Replies of up to 30,000 tokens: whatever the machine's speed or load, Ctrl+C lands while one streams."""
    command = dspark_run(str(engine_dir), "--temp", "0", "-n", "30000", "--threads", "1")
    child = pexpect.spawn(  # Ctrl+C must reach it even when the suite runs where SIGINT is ignored (in background)
        command[0], command[1:], encoding="utf-8", timeout=60, env={"OMP_NUM_THREADS": "1", "PATH": ""},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    child.expect(">>> ")
    child.sendline("def add(a, b):")
    child.expect("def add")  # the terminal echoes the line as it is typed
    time.sleep(0.5)  # the line read and the reply streaming (30,000 tokens take far longer)
    child.sendintr()  # Ctrl+C while the reply streams
    child.expect(r"\(interrupted\)")
    child.expect(r"\[[\d.]+ tok/s, (~[\d.]+x the target alone \(est\. from the speed curve\), )?[\d.]+ tokens/step, "
                 r"[\d.]+ drafts accepted/round \(\d+ of \d+ verified\), .* tokens, cancelled\]")
    child.expect(">>> ")
    child.sendline("/stats")
    child.expect(r"finish_reason +cancelled")
    child.expect(">>> ")
    child.sendline("/help")
    child.expect("forget the conversation")
    child.expect(">>> ")
    child.sendline("/model")
    child.expect("unknown command /model")
    child.expect(">>> ")
    child.sendintr()  # Ctrl+C at the prompt: how to quit
    child.expect(r"Ctrl\+D or /exit quits")
    child.expect(">>> ")
    child.sendline("/clear")
    child.expect("conversation cleared")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_the_first_run_on_the_demo_drafts_and_marks_the_drafts(tmp_path):
    """From a fresh HOME: the demo says what it is and suggests a prompt that Enter sends; the reply drafts
    (tokens/step well above 1) and its accepted drafts are in colour; piped, the same reply is plain text."""
    from dspark_runtime.cli import DEMO_PROMPT

    env = {"HOME": str(tmp_path), "DSPARK_HOME": str(tmp_path / "dspark"), "PATH": os.environ.get("PATH", ""),
           "TERM": "xterm", "OMP_NUM_THREADS": "1"}
    command = dspark_run("-n", "60", "--threads", "1")
    child = pexpect.spawn(command[0], command[1:], encoding="utf-8", timeout=180, env=env)
    child.expect("not an assistant")
    child.expect("Try: " + DEMO_PROMPT)
    child.expect(">>> ")
    child.sendline("")  # Enter sends the suggestion
    child.expect("sending the suggested prompt")
    child.expect("\x1b\\[36m")  # an accepted draft, in cyan
    child.expect(r"([\d.]+) tokens/step")
    assert float(child.match.group(1)) > 2.0
    child.expect(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    piped = subprocess.run(dspark_run("-p", DEMO_PROMPT, "-n", "60", "--threads", "1"), capture_output=True,
                           text=True, env=env, timeout=120)
    assert piped.returncode == 0 and piped.stdout.strip() and "\x1b[" not in piped.stdout
    for variant, extra in ((env | {"NO_COLOR": "1"}, []), (env, ["--no-color"])):  # a terminal, told not to colour
        command = dspark_run("-p", DEMO_PROMPT, "-n", "60", "--threads", "1", *extra)
        child = pexpect.spawn(command[0], command[1:], encoding="utf-8", timeout=120, env=variant)
        child.expect(pexpect.EOF)
        assert "tokens/step" in child.before and "\x1b[36m" not in child.before
        assert piped.stdout.strip().splitlines()[0] in child.before  # the same greedy reply


def test_one_shot_and_json(engine_dir):
    text = subprocess.run(dspark_run(str(engine_dir), "-p", "Hello", "--temp", "0", "-n", "8", "--threads", "1"),
                          capture_output=True, text=True, timeout=120)
    assert text.returncode == 0 and "tok/s" in text.stderr
    piped = subprocess.run(dspark_run(str(engine_dir), "--json", "--temp", "0", "-n", "8", "--threads", "1"),
                           input="Hello", capture_output=True, text=True, timeout=120)
    report = json.loads(piped.stdout)
    assert text.stdout == report["text"] + "\n" and report["stats"]["tokens"] == 8


def test_bad_invocations(engine_dir, tmp_path):
    missing = subprocess.run(dspark_run(str(tmp_path / "nowhere"), "-p", "hi"), capture_output=True, text=True)
    assert missing.returncode != 0 and "Traceback" not in missing.stderr and "nowhere" in missing.stderr
    not_engine = subprocess.run(dspark_run(str(tmp_path), "-p", "hi"), capture_output=True, text=True)
    assert not_engine.returncode == 1 and "neither a DSpark engine (no manifest.json)" in not_engine.stderr
    bad_flag = subprocess.run(dspark_run(str(engine_dir), "-p", "hi", "--top-p", "1.5"), capture_output=True, text=True)
    assert bad_flag.returncode == 2 and bad_flag.stderr.startswith("Error: Invalid value for '--top-p'")
    assert len(bad_flag.stderr.strip().splitlines()) == 1 and "--help` lists the options" in bad_flag.stderr
    bad_spec = subprocess.run(dspark_run(str(engine_dir), "-p", "hi", "--spec", "warp"), capture_output=True, text=True)
    assert bad_spec.returncode == 1 and "unknown speculation mode" in bad_spec.stderr
