"""`dspark-run serve`: an OpenAI-compatible HTTP server on one engine (Starlette + uvicorn).

GET /v1/models, POST /v1/completions and /v1/chat/completions, with `stream: true` as server-sent
events. Concurrent requests are batched by the engine's step loop. Bad requests get a 4xx with an
OpenAI-style error object; a client that disconnects mid-stream has its request cancelled.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from dspark_runtime.engine import Engine
from dspark_runtime.errors import DSparkError, MissingDependencyError
from dspark_runtime.sampling import SamplingParams

COMMON_FIELDS = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "seed",
                 "stream", "stream_options", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "user",
                 "logit_bias", "logprobs", "spec"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "top_logprobs"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def parse_body(raw: bytes, allowed: set[str], required: str) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unrecognized request argument supplied: {unknown[0]}", unknown[0])
    if required not in body:
        raise BadRequest(f"missing required parameter: {required}", required)
    if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    if body.get("logprobs") not in (None, False) or body.get("logit_bias") or body.get("echo") or body.get("suffix"):
        raise BadRequest("logprobs, logit_bias, echo and suffix are not supported")
    return body


def sampling_from(body: dict, defaults: dict) -> SamplingParams:
    stop = body.get("stop") or ()
    try:
        return SamplingParams(
            max_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens") or 256),
            temperature=float(body.get("temperature", defaults.get("temperature", 1.0))),
            top_p=float(body.get("top_p", defaults.get("top_p", 1.0))),
            top_k=int(body.get("top_k", defaults.get("top_k", 0))),
            min_p=float(body.get("min_p", defaults.get("min_p", 0.0))),
            presence_penalty=float(body.get("presence_penalty", 0.0)),
            frequency_penalty=float(body.get("frequency_penalty", 0.0)),
            repetition_penalty=float(body.get("repetition_penalty", 1.0)),
            seed=None if body.get("seed") is None else int(body["seed"]),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
        )
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from None


def create_app(engine: Engine, model_name: str, default_spec: str | None = None):
    """The Starlette application serving `engine` as model `model_name`."""
    try:
        from starlette.applications import Starlette
        from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
        from starlette.requests import Request
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route
    except ImportError:
        raise MissingDependencyError("dspark-run serve needs starlette and uvicorn: pip install 'dspark[serve]'") from None

    defaults = engine.generation_defaults()

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dspark"}]})

    async def completions(request: Request):
        return await respond(request, chat=False)

    async def chat_completions(request: Request):
        return await respond(request, chat=True)

    async def respond(request: Request, chat: bool):
        try:
            body = parse_body(await request.body(), CHAT_FIELDS if chat else COMPLETION_FIELDS, "messages" if chat else "prompt")
            prompt = body["messages"] if chat else body["prompt"]
            if chat and not (isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)):
                raise BadRequest("messages must be a list of {role, content} objects", "messages")
            if not chat and isinstance(prompt, list):
                if len(prompt) != 1 or not isinstance(prompt[0], str):
                    raise BadRequest("prompt must be one string", "prompt")
                prompt = prompt[0]
            if not chat and not isinstance(prompt, str):
                raise BadRequest("prompt must be a string", "prompt")
            if chat:
                prompt = [{"role": m["role"], "content": m.get("content") or ""} for m in prompt]
            params = sampling_from(body, defaults)
            handle = engine.submit(prompt, params, body.get("spec", default_spec), stream=bool(body.get("stream")))
        except BadRequest as exc:
            return JSONResponse(error_body(str(exc), exc.param), status_code=400)
        except DSparkError as exc:
            return JSONResponse(error_body(str(exc)), status_code=400)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            return StreamingResponse(stream(handle, ident, created, chat, body), media_type="text/event-stream")
        result = await run_in_threadpool(handle.result)
        choice: dict[str, Any] = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": result.text}} if chat else {"text": result.text}
        usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": len(handle.sequence.generated),
                 "total_tokens": result.prompt_tokens + len(handle.sequence.generated)}
        return JSONResponse({"id": ident, "object": kind, "created": created, "model": model_name,
                             "choices": [choice], "usage": usage, "dspark": result.stats})

    async def stream(handle, ident: str, created: int, chat: bool, body: dict):
        kind = "chat.completion.chunk" if chat else "text_completion"
        try:
            if chat:
                yield sse({"id": ident, "object": kind, "created": created, "model": model_name,
                           "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
            async for delta in iterate_in_threadpool(iter(handle)):
                part = {"delta": {"content": delta.text} if delta.text else {}} if chat else {"text": delta.text, "logprobs": None}
                yield sse({"id": ident, "object": kind, "created": created, "model": model_name,
                           "choices": [{"index": 0, **part, "finish_reason": delta.finish_reason}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                prompt_tokens, completion_tokens = len(handle.sequence.prompt), len(handle.sequence.generated)
                yield sse({"id": ident, "object": kind, "created": created, "model": model_name, "choices": [],
                           "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                     "total_tokens": prompt_tokens + completion_tokens}})
            yield "data: [DONE]\n\n"
        finally:
            if handle.sequence.finish_reason is None:  # the client went away mid-stream
                handle.cancel()

    async def not_found(request: Request, exc) -> JSONResponse:
        return JSONResponse(error_body(f"no route {request.method} {request.url.path}", kind="not_found_error"), status_code=404)

    async def method_not_allowed(request: Request, exc) -> JSONResponse:
        return JSONResponse(error_body(f"{request.method} is not allowed on {request.url.path}"), status_code=405)

    routes = [Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed})


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def serve(engine: Engine, model_name: str, host: str, port: int, default_spec: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn shuts down gracefully), then stop the engine."""
    try:
        import uvicorn
    except ImportError:
        raise MissingDependencyError("dspark-run serve needs starlette and uvicorn: pip install 'dspark[serve]'") from None
    uvicorn.run(create_app(engine, model_name, default_spec), host=host, port=port, log_level="info")
