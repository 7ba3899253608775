"""`dspark-run serve` on loopback: OpenAI-style completions and chat, streaming, concurrency, bad requests,
and a client that disconnects mid-stream."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("torch")

from dspark_runtime import Engine, SamplingParams  # noqa: E402
from dspark_runtime.server import create_app  # noqa: E402
from tests.conftest import build_echo_engine  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = build_echo_engine(tmp_path_factory.mktemp("serve"), context=1024, flat_curve=True)
    engine = Engine.load(folder, threads=1)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app_server = uvicorn.Server(uvicorn.Config(create_app(engine, "echo"), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=app_server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not app_server.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    app_server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


def test_models(server):
    url, _ = server
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "echo"


def test_completion_matches_the_engine(server):
    url, engine = server
    expected = engine.generate("Hello there", SamplingParams(max_tokens=12, temperature=0.0))
    body = {"model": "echo", "prompt": "Hello there", "max_tokens": 12, "temperature": 0}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=30).json()
    assert reply["choices"][0]["text"] == expected.text
    assert reply["usage"]["completion_tokens"] == 12 and reply["choices"][0]["finish_reason"] == "length"


def test_streamed_chat_equals_the_plain_reply(server):
    url, _ = server
    body = {"model": "echo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "temperature": 0}
    plain = httpx.post(url + "/v1/chat/completions", json=body, timeout=30).json()["choices"][0]["message"]["content"]
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True}, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == plain
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests(server):
    url, _ = server
    prompts = ["Hello", "def add(", "The answer", "Hello there"] * 2

    def ask(prompt):
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0}
        return httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, prompts))
    assert texts[:4] == texts[4:]


@pytest.mark.parametrize("payload, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"prompt": "x", "temprature": 0.5}).encode(), 400, "unrecognized request argument supplied: temprature"),
    (json.dumps({"prompt": "x", "n": 2}).encode(), 400, "only n=1"),
    (json.dumps({"prompt": "x", "temperature": -1}).encode(), 400, "temperature must be >= 0"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "missing required parameter: prompt"),
])
def test_bad_requests_get_openai_errors(server, payload, status, fragment):
    url, _ = server
    reply = httpx.post(url + "/v1/completions", content=payload, headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == status and fragment in reply.json()["error"]["message"]
    assert httpx.get(url + "/v1/models").status_code == 200  # still serving
    assert httpx.get(url + "/v1/nothing").json()["error"]["type"] == "not_found_error"


def test_disconnect_mid_stream_cancels_the_request(server, monkeypatch):
    url, engine = server
    submitted = []
    original = engine.submit
    monkeypatch.setattr(engine, "submit", lambda *a, **k: submitted.append(original(*a, **k)) or submitted[-1])
    body = {"prompt": "Hello", "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk
    deadline = time.time() + 10
    while engine.status()["active"] and time.time() < deadline:
        time.sleep(0.05)
    assert submitted[0].sequence.finish_reason == "cancelled" and len(submitted[0].sequence.generated) < 1000
    status = engine.status()
    assert not status["active"] and status["free_slots"] == status["slots"]
