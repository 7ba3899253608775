"""`dspark-run serve`: an OpenAI-compatible HTTP server on one engine (Starlette + uvicorn).

GET /v1/models, POST /v1/completions and /v1/chat/completions, with `stream: true` as server-sent events, and
GET / a web chat (`runtime/dspark_runtime/web`: three static files, nothing fetched from elsewhere). Each streamed chunk
also carries `dspark`: its text cut into drafted and target runs, the target steps behind it (drafts proposed,
verified, accepted) and, on the last, the request's figures. Concurrent requests are batched by the engine's
step loop. Built for a desktop where any web page the user opens can reach loopback:
- a POST must be JSON (`Content-Type: application/json`): a page cannot send that without a CORS preflight,
  and this server grants none; a request from a foreign `Origin` is refused outright;
- the `Host` header must name the address the server listens on (or one given with `--allow-host`), so a
  page cannot reach it through a DNS name rebound to 127.0.0.1;
- `--api-key` makes `Authorization: Bearer <key>` required;
- bodies over `max_body_bytes` are refused, and prompts are tokenized off the event loop;
- every invalid request gets a 4xx with an OpenAI-style error object, never a 500, and a request's failure
  ends its own stream with an error event; a client that disconnects has its request cancelled, streaming
  or not.
"""

from __future__ import annotations

import asyncio
import errno
import json
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources
from itertools import accumulate
from typing import Any

from dspark_runtime.engine import Completion, Engine, Request
from dspark_runtime.output import Delta
from dspark_common.errors import DSparkError, InvalidRequestError, MissingDependencyError
from dspark_common.prompts import DEMO_NOTE, DEMO_PROMPT
from dspark_common.sampling import MAX_LOGPROBS, SamplingParams
from dspark_runtime.logprobs import TokenLogprob
from dspark_common.tokenizer import ChatTokenizer

COMMON_FIELDS = {
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "user",
    "logit_bias",
    "logprobs",
    "spec",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "top_logprobs"}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
WEB_FILES = {"/": ("index.html", "text/html; charset=utf-8"), "/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
             "/chat.css": ("chat.css", "text/css; charset=utf-8")}
WEB_HEADERS = {  # the page runs only its own script and style and talks only to this server
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
WILDCARD = {"0.0.0.0", "::", ""}


@dataclass
class ServerOptions:
    model_name: str
    default_spec: str | None = None
    host: str = "127.0.0.1"  # the bound address; requests must name it (or an allowed host) in `Host`
    allow_hosts: tuple[str, ...] = ()
    api_key: str | None = None
    max_body_bytes: int = 2 << 20
    hosts: set[str] = field(init=False)

    def __post_init__(self) -> None:
        self.hosts = {self.host, *self.allow_hosts} | (LOOPBACK if self.host in LOOPBACK else set())


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def host_name(value: str) -> str:
    """The host part of a `Host` or `Origin` value ("[::1]:8000" -> "::1", "http://a.b:80" -> "a.b")."""
    value = value.split("://", 1)[-1].split("/", 1)[0]
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def check_request(headers, method: str, options: ServerOptions, public: bool = False) -> None:
    """Refuse what a web page or a stranger could send: wrong Host, foreign Origin, no API key (unless `public`, as
    a health check is), non-JSON."""
    if options.host not in WILDCARD or options.allow_hosts:
        if host_name(headers.get("host", "")) not in options.hosts:
            raise HTTPError(403, "the Host header does not name this server (use --allow-host to add a name)")
    origin = headers.get("origin")
    if origin is not None and host_name(origin) not in options.hosts:
        raise HTTPError(403, "requests from other origins are not served")
    if not public and options.api_key is not None and headers.get("authorization", "") != f"Bearer {options.api_key}":
        raise HTTPError(401, "a valid API key is required (Authorization: Bearer <key>)", code="invalid_api_key")
    if method == "POST" and headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise HTTPError(415, "the request body must be JSON (Content-Type: application/json)")


def parse_body(raw: bytes, allowed: set[str], required: str, model_names: tuple[str, ...]) -> dict:
    """The request's JSON object, checked: known fields only, the required one present, a model this server has
    (`model_names`: its id first, then the names it also answers to)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # JSON errors, bad UTF-8, integers too long to read, deep nesting
        raise HTTPError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise HTTPError(400, f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
    if required not in body:
        raise HTTPError(400, f"missing required parameter: {required}", required)
    if "model" in body and body["model"] not in model_names:
        raise HTTPError(404, f"the model {str(body['model'])[:100]!r} does not exist (this server has "
                             f"{model_names[0]!r})", "model", code="model_not_found")
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise HTTPError(400, "only n=1 is supported", "n")
    if body.get("logit_bias") or body.get("echo") or body.get("suffix"):
        raise HTTPError(400, "logit_bias, echo and suffix are not supported")
    if not isinstance(body.get("stream", False), bool):
        raise HTTPError(400, "stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not (
        isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)
    ):
        raise HTTPError(400, "stream_options must be an object with a boolean include_usage", "stream_options")
    if body.get("spec") is not None and not isinstance(body["spec"], str):
        raise HTTPError(400, "spec must be a string such as 'async' or 'fixed:4'", "spec")
    return body


def requested_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the request wants with its log-probabilities (None: none): chat asks with
    `logprobs: true` and `top_logprobs` (0-20), completions with `logprobs` (0-5)."""
    if not chat:
        count = body.get("logprobs")
        if count is not None and not (isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= 5):
            raise HTTPError(400, "logprobs must be an integer in [0, 5] for completions", "logprobs")
        return count
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise HTTPError(400, "logprobs must be true or false", "logprobs")
    if top is not None and not (isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= MAX_LOGPROBS):
        raise HTTPError(400, f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
    if top is not None and not wanted:
        raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def logprobs_json(entries: list[TokenLogprob] | None, tokenizer: ChatTokenizer, chat: bool, offset: int = 0):
    """OpenAI's `logprobs` object for some emitted tokens: chat's `content` list, or the completions API's parallel
    lists (`text_offset` counts characters from `offset`, where the tokens' text starts)."""
    if entries is None:
        return None

    def token(token_id: int) -> tuple[str, bytes]:
        raw = tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw

    if chat:
        def item(token_id: int, logprob: float) -> dict:
            text, raw = token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(raw)}

        return {"content": [item(e.token, e.logprob) | {"top_logprobs": [item(*alt) for alt in e.top]}
                            for e in entries], "refusal": None}
    texts = [token(e.token)[0] for e in entries]
    offsets = list(accumulate((len(text) for text in texts[:-1]), initial=offset)) if texts else []
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token(t)[0]: lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def sampling_from(body: dict, engine: Engine, chat: bool) -> SamplingParams:
    """The request's sampling settings: what it sets (as sent, validated by SamplingParams), the engine's
    defaults for the rest (`Engine.default_params`, as the CLI and the Python API)."""
    return engine.default_params(
        max_tokens=body.get("max_completion_tokens", body.get("max_tokens", 256)),
        temperature=body.get("temperature"),
        top_p=body.get("top_p"),
        top_k=body.get("top_k"),
        min_p=body.get("min_p"),
        presence_penalty=body.get("presence_penalty"),
        frequency_penalty=body.get("frequency_penalty"),
        repetition_penalty=body.get("repetition_penalty"),
        seed=body.get("seed"),
        stop=body.get("stop"),
        logprobs=requested_logprobs(body, chat),
    )


def prompt_of(body: dict, chat: bool):
    if chat:
        if not isinstance(body["messages"], list) or not body["messages"]:
            raise HTTPError(400, "messages must be a non-empty list of {role, content} objects", "messages")
        return body["messages"]  # checked, and content parts joined, by the engine
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise HTTPError(400, "prompt must be a string", "prompt")
    return prompt


def create_app(engine: Engine, options: ServerOptions | str, default_spec: str | None = None):
    """The Starlette application serving `engine` (`options` may be just the model name)."""
    try:
        from starlette.applications import Starlette
        from starlette.concurrency import run_in_threadpool
        from starlette.requests import ClientDisconnect, Request as HttpRequest
        from starlette.responses import JSONResponse, Response, StreamingResponse
        from starlette.routing import Route
    except ImportError:
        raise MissingDependencyError(
            "dspark-run serve needs starlette and uvicorn: pip install 'dspark[serve]'"
        ) from None
    if isinstance(options, str):
        options = ServerOptions(options, default_spec)
    model_name = options.model_name
    model_names = (model_name, *({engine.manifest.target_name} - {model_name, None}))  # the target's name too

    def error(exc: HTTPError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def read_body(request: HttpRequest) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > options.max_body_bytes):
            raise HTTPError(413, f"the request body exceeds {options.max_body_bytes} bytes")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > options.max_body_bytes:
                    raise HTTPError(413, f"the request body exceeds {options.max_body_bytes} bytes")
                chunks.append(chunk)
        except ClientDisconnect:  # a clean close: nobody is left to read the answer
            raise HTTPError(400, "the client closed the connection before its body was complete") from None
        return b"".join(chunks)

    async def health(request: HttpRequest) -> JSONResponse:
        """What llama.cpp's, vLLM's and Ollama's health checks answer: up, and how busy (no API key needed)."""
        try:
            check_request(request.headers, "GET", options, public=True)
        except HTTPError as exc:
            return error(exc)
        demo = engine.manifest.target_name == "demo"
        return JSONResponse({"status": "ok", "model": model_name, **engine.status(), "gamma": engine.gamma,
                             "profiled": engine.has_speed_curve, "temperature": engine.default_params().temperature,
                             "suggested_prompt": DEMO_PROMPT if demo else None, "note": DEMO_NOTE if demo else None})

    async def web(request: HttpRequest) -> Response:
        """The web chat's files (no API key to load them: the page asks for it when the API does)."""
        try:
            check_request(request.headers, "GET", options, public=True)
        except HTTPError as exc:
            return error(exc)
        name, media_type = WEB_FILES[request.url.path]
        return Response(web_file(name), media_type=media_type, headers=WEB_HEADERS)

    async def models(request: HttpRequest) -> JSONResponse:
        try:
            check_request(request.headers, "GET", options)
        except HTTPError as exc:
            return error(exc)
        return JSONResponse(
            {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dspark"}]}
        )

    async def completions(request: HttpRequest):
        return await respond(request, chat=False)

    async def chat_completions(request: HttpRequest):
        return await respond(request, chat=True)

    async def respond(request: HttpRequest, chat: bool):
        try:
            check_request(request.headers, "POST", options)
            body = parse_body(await read_body(request), CHAT_FIELDS if chat else COMPLETION_FIELDS,
                              "messages" if chat else "prompt", model_names)
            prompt = prompt_of(body, chat)
            params = sampling_from(body, engine, chat)
            handle = await run_in_threadpool(
                engine.submit, prompt, params, body.get("spec", options.default_spec), False, body.get("stream", False)
            )
        except HTTPError as exc:
            return error(exc)
        except InvalidRequestError as exc:
            return error(HTTPError(400, str(exc)))
        except DSparkError as exc:
            return error(HTTPError(503, str(exc), kind="server_error"))
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.get("stream"):
            return StreamingResponse(stream(request, handle, ident, created, chat, body),
                                     media_type="text/event-stream")
        async for _ in deltas(request, handle):
            pass
        try:
            result = handle.result()
        except DSparkError as exc:
            return error(HTTPError(500, str(exc), kind="server_error"))
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason,
                                  "logprobs": logprobs_json(result.logprobs, engine.tokenizer, chat)}
        choice |= {"message": {"role": "assistant", "content": result.text}} if chat else {"text": result.text}
        usage = usage_of(result)
        return JSONResponse(
            {
                "id": ident,
                "object": "chat.completion" if chat else "text_completion",
                "created": created,
                "model": model_name,
                "choices": [choice],
                "usage": usage,
                "dspark": asdict(result.stats),
            }
        )

    async def deltas(request: HttpRequest, handle: Request):
        """The request's deltas as they arrive, waited for on the event loop (no thread held per request, so that
        hundreds of waiting streams do not queue the running ones' deltas behind them); a client that goes away,
        while its request runs or waits for a slot, cancels it within 0.1 s."""
        loop, changed, index = asyncio.get_running_loop(), asyncio.Event(), 0

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(changed.set)
            except RuntimeError:  # the event loop closed (the server shut down): nobody is waiting any more
                pass

        handle.listen(wake)
        while True:
            changed.clear()
            new, ended = handle.deltas_from(index)
            for delta in new:
                yield delta
            index += len(new)
            if ended:
                return
            try:
                await asyncio.wait_for(changed.wait(), 0.1)
            except asyncio.TimeoutError:
                if await request.is_disconnected():  # nobody will read the answer: free the slot
                    handle.cancel()

    async def stream(request: HttpRequest, handle: Request, ident: str, created: int, chat: bool, body: dict):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list, **extra) -> str:
            return sse(
                {"id": ident, "object": kind, "created": created, "model": model_name, "choices": choices, **extra}
            )

        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            failed, sent = False, 0
            try:
                async for delta in deltas(request, handle):
                    logprobs = logprobs_json(delta.logprobs, engine.tokenizer, chat, sent)
                    part = {"delta": {"content": delta.text} if delta.text else {}} if chat else {"text": delta.text}
                    yield chunk([{"index": 0, **part, "logprobs": logprobs, "finish_reason": delta.finish_reason}],
                                dspark=provenance(delta, handle))
                    sent += len(delta.text)
            except DSparkError as exc:  # this request failed: say so, and end its stream properly
                yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": None}})
                yield chunk([{"index": 0, **({"delta": {}} if chat else {"text": ""}), "finish_reason": "error"}])
                failed = True
            if (body.get("stream_options") or {}).get("include_usage") and not failed:
                yield chunk([], usage=usage_of(handle.result()))
            yield "data: [DONE]\n\n"
        finally:
            if not handle.done:  # the client went away mid-stream
                handle.cancel()

    async def not_found(request: HttpRequest, exc) -> JSONResponse:
        return error(HTTPError(404, f"no route {request.method} {request.url.path}", kind="not_found_error"))

    async def method_not_allowed(request: HttpRequest, exc) -> JSONResponse:
        return error(HTTPError(405, f"{request.method} is not allowed on {request.url.path}"))

    def provenance(delta: Delta, handle: Request) -> dict:
        """A chunk's `dspark` object: drafted and target runs of its text, its target steps, and at the end the
        request's figures and the speed curve's estimate of its gain over the target alone."""
        extra: dict[str, Any] = {"spans": delta.spans(decode), "verifications": delta.verifications}
        if delta.finish_reason is not None and handle.completion is not None:
            stats = handle.completion.stats
            extra |= {"stats": asdict(stats), "speedup_estimate": engine.speedup_estimate(stats)}
        return extra

    def decode(ids: list[int]) -> str:
        return engine.tokenizer.decode(ids, skip_special_tokens=True)

    routes = [*(Route(path, web) for path in WEB_FILES), Route("/health", health), Route("/v1/models", models),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed})


@cache
def web_file(name: str) -> bytes:
    return (resources.files("dspark_runtime") / "web" / name).read_bytes()


def usage_of(result: Completion) -> dict:
    """OpenAI's `usage` object of a finished request."""
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens}


def sse(payload: dict) -> str:
    """One server-sent event. ASCII JSON: a U+2028 or U+0085 in generated text would end the line early for
    clients that split lines the way Python's `str.splitlines` does (httpx's `iter_lines`)."""
    return f"data: {json.dumps(payload)}\n\n"


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, taken before the engine loads; a port in use (or an address this machine
    lacks) is one error naming what to change."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port in TIME_WAIT is free
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise DSparkError(f"port {port} on {host} is in use (another server?); choose another with --port") \
                from None
        raise DSparkError(f"cannot listen on {host}:{port}: {exc.strerror}; check --host") from None
    return sock


def serve(engine: Engine, options: ServerOptions, sock: socket.socket) -> None:
    """Serve on `sock` (from `listening_socket`) until SIGINT/SIGTERM (uvicorn shuts down gracefully)."""
    try:
        import uvicorn
    except ImportError:
        raise MissingDependencyError(
            "dspark-run serve needs starlette and uvicorn: pip install 'dspark[serve]'"
        ) from None
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, options), host=host, port=port, log_level="info"))
    server.run(sockets=[sock])
