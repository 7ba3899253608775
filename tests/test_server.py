"""`dspark-run serve` on loopback: OpenAI-style completions and chat, streaming, concurrency, a table of
hostile requests each sent beside a good stream (none may get a 500 or hurt the stream), what a web page
could send (foreign Host or Origin, no JSON), API keys, body limits, disconnects, and a soak of 64 streams
with random aborts after which every slot is free."""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("torch")

from dspark_runtime import Engine, OrtBackend, SamplingParams  # noqa: E402
from dspark_runtime.server import ServerOptions, create_app  # noqa: E402
from tests.conftest import build_echo_engine  # noqa: E402
from tests.fakes import FakeBackend  # noqa: E402


def running(app):
    """Serve `app` on a free loopback port in a thread; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app_server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=app_server.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not app_server.started and time.time() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    app_server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = build_echo_engine(tmp_path_factory.mktemp("serve"), context=1024, flat_curve=True)
    with Engine.load(folder, OrtBackend(threads=1)) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine):
    yield from ((url, engine) for url in running(create_app(engine, ServerOptions("echo", max_body_bytes=1 << 20))))


def test_tokenizing_a_big_prompt_does_not_stall_the_other_streams(server):
    """The tokenizer releases the GIL while it works, so the step loop keeps stepping: a running stream's longest
    pause stays well below the time the big prompt takes to tokenize (all of it when the GIL was held)."""
    url, engine = server
    big = "def add(a, b):\n    return a + b\n" * 25000  # 800 kB, under the test server's 1 MiB limit
    started = time.perf_counter()
    engine.tokenizer.encode(big)
    tokenizing = time.perf_counter() - started
    body = {"prompt": "def add(", "max_tokens": 600, "temperature": 0, "stream": True}
    arrivals: list[float] = []

    def stream_beside():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.perf_counter())

    thread = threading.Thread(target=stream_beside)
    thread.start()
    deadline = time.perf_counter() + 30
    while len(arrivals) < 5 and time.perf_counter() < deadline:
        time.sleep(0.01)
    sent = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json={"prompt": big, "max_tokens": 1}, timeout=120)
    thread.join()
    assert reply.status_code == 400 and "context holds" in reply.text  # tokenized, then refused: too long
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > sent]
    assert during and max(during) < tokenizing / 3, (max(during, default=None), tokenizing)


def test_a_body_cut_short_by_the_client_is_a_clean_close(server):
    url, engine = server
    host, port = url.removeprefix("http://").split(":")
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    logging.getLogger("uvicorn.error").addHandler(handler)  # where uvicorn reports an application's exception
    try:
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: "
                           b"application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"prompt": "Hel')
        time.sleep(0.5)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not errors, [record.getMessage() for record in errors]
    assert httpx.post(url + "/v1/completions", json=completion(), timeout=30).status_code == 200


def wait_idle(engine, seconds: float = 20) -> dict:
    deadline = time.time() + seconds
    while engine.status()["active"] + engine.status()["waiting"] and time.time() < deadline:
        time.sleep(0.05)
    return engine.status()


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


def test_logprobs_are_the_targets_whatever_the_speculation(server):
    """Chat and completions, plain and streamed, under `off` and `fixed:3`: the same tokens and log-probabilities
    (the target's rows give them), the alternatives sorted with the emitted token among them when greedy."""
    url, _ = server
    chat = {"messages": [{"role": "user", "content": "def add("}], "max_tokens": 24, "temperature": 0,
            "logprobs": True, "top_logprobs": 3}
    replies = {spec: httpx.post(url + "/v1/chat/completions", json=chat | {"spec": spec}, timeout=30).json()
               for spec in ("off", "fixed:3")}
    off, spec = (replies[k]["choices"][0]["logprobs"]["content"] for k in ("off", "fixed:3"))
    assert len(off) == replies["off"]["usage"]["completion_tokens"] == 24
    assert [e["token"] for e in off] == [e["token"] for e in spec]
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(off, spec)) < 1e-4
    for entry in off:
        top = entry["top_logprobs"]
        assert len(top) == 3 and top[0] == {k: entry[k] for k in ("token", "logprob", "bytes")}
        assert top[0]["logprob"] >= top[1]["logprob"] >= top[2]["logprob"] and entry["logprob"] <= 0
        assert bytes(entry["bytes"]).decode("utf-8", errors="replace") == entry["token"]
    text = replies["off"]["choices"][0]["message"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in off).decode() == text
    streamed = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat | {"stream": True, "spec": "fixed:3"},
                      timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                streamed += (json.loads(line[6:])["choices"][0].get("logprobs") or {}).get("content", [])
    assert [e["token"] for e in streamed] == [e["token"] for e in off]
    plain = {"prompt": "def add(", "max_tokens": 12, "temperature": 0, "logprobs": 2}
    reply = httpx.post(url + "/v1/completions", json=plain, timeout=30).json()["choices"][0]
    logprobs = reply["logprobs"]
    assert "".join(logprobs["tokens"]) == reply["text"] and len(logprobs["token_logprobs"]) == 12
    assert logprobs["text_offset"][0] == 0 and all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert httpx.post(url + "/v1/completions", json=plain | {"logprobs": None}, timeout=30).json()["choices"][0][
        "logprobs"] is None


def test_a_stream_reports_its_usage_when_asked(server):
    url, _ = server
    body = completion(max_tokens=9, stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 9
    assert events[-1]["usage"]["total_tokens"] == events[-1]["usage"]["prompt_tokens"] + 9


def test_concurrent_requests(server):
    url, _ = server
    prompts = ["Hello", "def add(", "The answer", "Hello there"] * 2

    def ask(prompt):
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0}
        return httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(ask, prompts))
    assert texts[:4] == texts[4:]


def chat_body(content) -> dict:
    return {"model": "echo", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}


def completion(**fields) -> dict:
    return {"prompt": "Hello", "max_tokens": 4, "temperature": 0} | fields


HOSTILE = [  # (route, raw body, expected status, a fragment of the error message)
    ("completions", b"{not json", 400, "not valid JSON"),
    ("completions", b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON"),
    ("completions", json.dumps(completion(temprature=0.5)).encode(), 400, "unrecognized request argument supplied"),
    ("completions", json.dumps(completion(n=2)).encode(), 400, "only n=1"),
    ("completions", json.dumps(completion(temperature=-1)).encode(), 400, "temperature must be in"),
    ("completions", json.dumps({"max_tokens": 3}).encode(), 400, "missing required parameter: prompt"),
    ("completions", json.dumps(completion(stop=[1])).encode(), 400, "stop must be"),
    ("completions", json.dumps(completion(stop=[None])).encode(), 400, "stop must be"),
    ("completions", json.dumps(completion(stop=[""])).encode(), 400, "stop must be"),
    ("completions", json.dumps(completion(temperature=1e-320)).encode(), 200, ""),  # below the floor: greedy
    ("completions", b'{"prompt": "x", "max_tokens": 1e400}', 400, "max_tokens must be an integer"),
    ("completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, "not valid JSON"),
    ("completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 4000 + b"}", 400, "max_tokens must be in"),
    ("completions", json.dumps(completion(max_tokens=0)).encode(), 400, "max_tokens must be in"),
    ("completions", b'{"prompt": "x", "top_k": Infinity}', 400, "top_k must be an integer"),
    ("completions", b'{"prompt": "x", "presence_penalty": NaN}', 400, "presence_penalty must be a finite number"),
    ("completions", json.dumps(completion(seed=-1)).encode(), 400, "seed must be in"),
    ("completions", json.dumps(completion(spec=5)).encode(), 400, "spec must be a string"),
    ("completions", json.dumps(completion(spec="turbo")).encode(), 400, "unknown speculation mode"),
    ("completions", json.dumps(completion(model="gpt-5")).encode(), 404, "does not exist"),
    ("completions", json.dumps(completion(model="target")).encode(), 200, ""),  # the target's name works too
    ("completions", json.dumps(completion(prompt=5)).encode(), 400, "prompt must be a string"),
    ("completions", b'{"prompt": "\\ud800"}'.replace(b"\\\\", b"\\"), 400, "not valid Unicode"),
    ("completions", json.dumps(completion(stream=True, stream_options="x")).encode(), 400, "stream_options must be"),
    ("completions", json.dumps(completion(stream="yes")).encode(), 400, "stream must be true or false"),
    ("completions", json.dumps(completion(prompt="Hello " * 2000)).encode(), 400, "context holds"),
    ("completions", json.dumps(completion(logprobs=6)).encode(), 400, "logprobs must be an integer in [0, 5]"),
    ("completions", json.dumps(completion(logprobs=True)).encode(), 400, "logprobs must be an integer"),
    ("chat/completions", json.dumps(chat_body("Hi") | {"logprobs": 3}).encode(), 400, "logprobs must be true or"),
    ("chat/completions", json.dumps(chat_body("Hi") | {"top_logprobs": 2}).encode(), 400, "needs logprobs: true"),
    ("chat/completions", json.dumps(chat_body("Hi") | {"logprobs": True, "top_logprobs": 21}).encode(), 400,
     "top_logprobs must be an integer in [0, 20]"),
    ("chat/completions", json.dumps(chat_body(5)).encode(), 400, "content must be a string"),
    ("chat/completions", json.dumps(chat_body({"text": "hi"})).encode(), 400, "content must be a string"),
    ("chat/completions", json.dumps(chat_body([{"type": "text", "text": "Hello"}])).encode(), 200, ""),
    ("chat/completions", json.dumps({"messages": [{"content": "hi"}]}).encode(), 400, "needs a role"),
    ("chat/completions", json.dumps({"messages": "hi"}).encode(), 400, "messages must be a non-empty list"),
    ("chat/completions", json.dumps({"messages": [{"role": "developer", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi"}]}).encode(), 200, ""),
    ("chat/completions", json.dumps({"messages": [{"role": "user", "content": "Weather?"},
                                                 {"role": "assistant", "content": "Looking."},
                                                 {"role": "tool", "content": "sunny"}]}).encode(), 200, ""),
]


@pytest.mark.parametrize(
    "route, payload, status, fragment", HOSTILE, ids=[f"{i}-{row[3] or 'ok'}" for i, row in enumerate(HOSTILE)]
)
def test_a_hostile_request_gets_a_clear_4xx_and_hurts_no_other_request(server, route, payload, status, fragment):
    url, engine = server
    expected = engine.generate("def add(", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)).text
    body = {"prompt": "def add(", "max_tokens": 40, "temperature": 0, "stream": True}
    good, text = {}, []

    def stream_beside():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    text.append(event["choices"][0]["text"])
                    good["finish"] = event["choices"][0]["finish_reason"] or good.get("finish")
                good["done"] = line == "data: [DONE]" or good.get("done", False)

    beside = threading.Thread(target=stream_beside)
    beside.start()
    reply = httpx.post(url + f"/v1/{route}", content=payload, headers={"content-type": "application/json"}, timeout=60)
    beside.join(timeout=60)
    assert reply.status_code == status, reply.text
    if status != 200:
        assert fragment in reply.json()["error"]["message"]
    assert good.get("done") and good.get("finish") in ("length", "stop")
    if good["finish"] == "length":
        assert "".join(text) == expected
    assert httpx.get(url + "/v1/nothing").json()["error"]["type"] == "not_found_error"


def test_the_web_chat_is_served_under_the_same_host_and_origin_rules(server):
    url, _ = server
    port = url.rsplit(":", 1)[1]
    for path, kind in (("/", "text/html"), ("/chat.js", "text/javascript"), ("/chat.css", "text/css")):
        page = httpx.get(url + path, timeout=30)
        assert page.status_code == 200 and page.headers["content-type"].startswith(kind) and page.content
        assert "default-src 'none'" in page.headers["content-security-policy"]
    assert "/chat.js" in httpx.get(url + "/").text and "http" not in httpx.get(url + "/").text  # nothing external
    assert httpx.get(url + "/", headers={"host": f"evil.example:{port}"}).status_code == 403
    assert httpx.get(url + "/chat.js", headers={"origin": "http://evil.example"}).status_code == 403


def test_what_a_web_page_could_send_is_refused(server):
    url, _ = server
    port = url.rsplit(":", 1)[1]
    body = json.dumps(completion()).encode()
    plain = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "text/plain"}, timeout=30)
    assert plain.status_code == 415 and "must be JSON" in plain.json()["error"]["message"]
    rebound = httpx.post(url + "/v1/completions", content=body, timeout=30,
                         headers={"content-type": "application/json", "host": f"evil.example:{port}"})
    assert rebound.status_code == 403 and "Host" in rebound.json()["error"]["message"]
    foreign = httpx.post(url + "/v1/completions", content=body, timeout=30,
                         headers={"content-type": "application/json", "origin": "http://evil.example"})
    assert foreign.status_code == 403
    big = httpx.post(
        url + "/v1/completions", content=b" " * (2 << 20), headers={"content-type": "application/json"}, timeout=30
    )
    assert big.status_code == 413


def test_an_api_key_is_required_when_set(engine):
    for url in running(create_app(engine, ServerOptions("echo", api_key="s3cret"))):
        assert httpx.get(url + "/v1/models").status_code == 401
        health = httpx.get(url + "/health")  # what load balancers probe: no key needed, nothing private
        assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["slots"] == 8
        headers = {"authorization": "Bearer s3cret"}
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 200
        reply = httpx.post(url + "/v1/completions", json=completion(), headers=headers, timeout=30)
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    """The echo engine's directory served on a slower model (a pure-numpy target, 3 ms a step, no drafter)."""
    folder = build_echo_engine(tmp_path_factory.mktemp("slow"), context=1024, flat_curve=True)
    with Engine.load(folder, FakeBackend(delay=0.003)) as engine:
        yield from ((url, engine) for url in running(create_app(engine, ServerOptions("echo"))))


def test_disconnect_mid_stream_cancels_the_request(slow_server):
    url, engine = slow_server
    before = engine.finish_reasons()["cancelled"]
    body = {"prompt": "Hello", "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk
    status = wait_idle(engine)
    assert engine.finish_reasons()["cancelled"] == before + 1  # not run out to its 1000 tokens (3 s)
    assert not status["active"] and status["free_slots"] == status["slots"]


def test_a_disconnect_cancels_a_plain_request_too(slow_server):
    url, engine = slow_server
    before = engine.finish_reasons()["cancelled"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=completion(max_tokens=1000), timeout=0.3)
    status = wait_idle(engine)
    assert engine.finish_reasons()["cancelled"] == before + 1 and status["free_slots"] == status["slots"]


def test_soak_64_streams_with_random_aborts(server):
    """64 concurrent streaming requests through the real server, about a third abandoned mid-stream: every
    other one completes with a finish reason, and afterwards every slot is free and nothing is queued."""
    url, engine = server
    rng = random.Random(0)
    plans = [
        (rng.choice(["Hello", "def add(", "The answer"]), rng.randint(4, 40), rng.random() < 0.33) for _ in range(64)
    ]

    def run(plan) -> str | None:
        prompt, tokens, abort = plan
        body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.7, "stream": True}
        finish = None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            for number, line in enumerate(response.iter_lines()):
                if abort and number >= 2:
                    return "aborted"
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        return finish

    with ThreadPoolExecutor(64) as pool:
        outcomes = list(pool.map(run, plans))
    completed = [o for o, (_, _, abort) in zip(outcomes, plans) if not abort]
    assert completed and all(o in ("length", "stop") for o in completed), outcomes
    status = wait_idle(engine, 60)
    assert status == {"active": 0, "waiting": 0, "free_slots": status["slots"], "slots": status["slots"]}


def test_under_load_every_abandoned_stream_is_cancelled(slow_server):
    """128 streams for 8 slots on a slowed model, a quarter abandoned after their first event: deltas reach their
    clients as they are made (no thread is held per waiting stream), so abandoned requests are cancelled, not run
    out. (With 256 streams of 100 tokens, 40 threads once served all streams and 42 of 54 first events arrived
    after their request had ended.)"""
    url, engine = slow_server
    before = engine.finish_reasons()

    def go(number: int) -> str | None:
        body = {"prompt": f"Hello {number}", "max_tokens": 100, "temperature": 0.7, "stream": True}
        finish = None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if number % 4 == 1 and line.startswith("data: {"):
                    return "abandoned"  # after the first event
                if line.startswith("data: {"):
                    finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
        return finish

    with ThreadPoolExecutor(128) as pool:
        outcomes = list(pool.map(go, range(128)))
    wait_idle(engine, 120)
    after = engine.finish_reasons()
    assert outcomes.count("abandoned") == 32 and outcomes.count("length") == 96  # the fake model never ends itself
    assert after["cancelled"] - before["cancelled"] == 32 and after["length"] - before["length"] == 96


def test_events_stay_one_line_whatever_the_text():
    """Generated text may hold U+2028 or U+0085, which `str.splitlines` (httpx's `iter_lines`) treats as line ends."""
    from dspark_runtime.server import sse

    event = sse({"text": "a\u2028b\x85c\nd"})
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: "):])["text"] == "a\u2028b\x85c\nd"


def test_cli_server_and_api_fill_an_unset_temperature_alike(server, monkeypatch):
    """A request that sets no temperature samples at the model's default (SamplingParams', or its
    generation_config.json's) through the Python API, the server and the CLI alike."""
    from click.testing import CliRunner

    from dspark_runtime.cli import main
    from dspark_runtime.server import sampling_from

    _, engine = server
    api = engine.submit("Hello", None, "off").params
    served = sampling_from({"prompt": "Hello"}, engine, chat=False)
    built = []
    original = Engine.default_params
    monkeypatch.setattr(Engine, "default_params", lambda self, **kw: built.append(original(self, **kw)) or built[-1])
    result = CliRunner().invoke(main, [str(engine.folder), "-p", "Hello", "-n", "2", "--threads", "1"])
    assert result.exit_code == 0, result.output
    assert api.temperature == served.temperature == built[0].temperature == SamplingParams().temperature
    assert (api.top_p, api.top_k, api.min_p) == (served.top_p, served.top_k, served.min_p)
