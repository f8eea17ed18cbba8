"""The OpenAI-compatible HTTP API (a Starlette app; ``ds4tools serve`` runs it under uvicorn).

    POST /v1/completions        text completion; "stream": true for server-sent events
    POST /v1/chat/completions   chat, through the model's chat template; streams too
    GET  /v1/models             the one model served
    GET  /health                {"status": "ok", slots...}; never needs the API key
    GET  /metrics               Prometheus text: requests, tokens, tokens/s, acceptance

Every error is OpenAI's error object with its status: 400 bad input, 401 a wrong or missing API
key, 404 / 405 unknown routes and methods, 413 a body over the limit, 503 a full queue (with
Retry-After), 500 a failure inside the server (logged; the server goes on).

Streams: one ``data: {chunk}`` event per piece of text, then a chunk with ``finish_reason`` that
always carries ``usage`` and ``ds4tools``; with ``stream_options.include_usage`` an extra
OpenAI-style chunk with empty ``choices`` and ``usage`` follows; then ``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .errors import APIError, bad_request
from .requests import parse_chat, parse_completion
from .slots import Job, QueueFull

log = logging.getLogger("ds4tools.serve")

#: the largest request body read
MAX_BODY_BYTES = 16 << 20
#: how often a waiting non-streaming request checks that its client is still there
DISCONNECT_POLL_SECONDS = 0.25


@dataclass
class ServerState:
    pool: object                  # SlotPool
    metrics: object               # Metrics
    model_id: str
    n_ctx: int
    tokenizer: object             # the engines' (shared) tokenizer
    template: object | None       # ChatTemplate
    api_key: str | None = None
    retry_after: int = 1
    created: int = 0
    speculative: str | None = None
    greedy_only: bool = False     # --dspark-strict: sampling requests are refused

    @property
    def model_names(self) -> set:
        return {self.model_id}

    def count_tokens(self, text: str) -> int:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in the JSON)
            raise bad_request(f"the prompt is not valid Unicode: {e.reason} at character {e.start}",
                              None, "invalid_value") from None
        return len(self.tokenizer.encode(text))


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _authorize(state: ServerState, request: Request) -> None:
    if state.api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        token = request.headers.get("x-api-key", "")
    if not token:
        raise APIError(401, "missing API key: send 'Authorization: Bearer KEY'",
                       type="invalid_request_error", code="invalid_api_key")
    if not hmac.compare_digest(token.strip().encode("utf-8"), state.api_key.encode("utf-8")):
        raise APIError(401, "incorrect API key", type="invalid_request_error", code="invalid_api_key")


async def _json_body(request: Request):
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    raw = b""
    async for part in request.stream():
        raw += part
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="request_too_large")
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object", None, "invalid_json")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8", None, "invalid_json") from None
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    return body


def build_app(state: ServerState) -> Starlette:
    metrics = state.metrics

    def endpoint(name, *, auth=True):
        def wrap(handler):
            async def run(request: Request) -> Response:
                try:
                    if auth:
                        _authorize(state, request)
                    response = await handler(request)
                except APIError as e:
                    response = _error_response(e)
                except Exception as e:  # a bug: answer 500 and keep serving
                    log.exception("%s failed", name)
                    response = _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}",
                                                        type="server_error", code="internal_error"))
                metrics.count_request(name, response.status_code)
                return response
            return run
        return wrap

    @endpoint("health", auth=False)
    async def health(request):
        busy, waiting = state.pool.counts()
        return JSONResponse({"status": "ok", "model": state.model_id, "slots_total": state.pool.slots,
                             "slots_busy": busy, "slots_idle": state.pool.slots - busy,
                             "queue_waiting": waiting, "queue_size": state.pool.queue_size})

    @endpoint("metrics")
    async def metrics_(request):
        busy, waiting = state.pool.counts()
        return PlainTextResponse(metrics.render(state.pool.slots, busy, waiting),
                                 media_type="text/plain; version=0.0.4")

    @endpoint("models")
    async def models(request):
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    @endpoint("model")
    async def model(request):
        name = request.path_params["name"]
        if name not in state.model_names:
            raise APIError(404, f"the model '{name}' does not exist", param="model",
                           code="model_not_found")
        return JSONResponse(_model_card(state))

    # checking a request tokenizes its prompt (and renders a chat template): off the event loop
    @endpoint("completions")
    async def completions(request):
        body = await _json_body(request)
        return await _generate(state, request, await asyncio.to_thread(parse_completion, body, state))

    @endpoint("chat.completions")
    async def chat_completions(request):
        body = await _json_body(request)
        return await _generate(state, request, await asyncio.to_thread(parse_chat, body, state))

    async def http_error(request, exc: HTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        metrics.count_request("other", exc.status_code)
        return _error_response(APIError(exc.status_code, msg, code=kind, headers=getattr(exc, "headers", None)))

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        # the same without the /v1 prefix, as llama.cpp's server answers them
        Route("/models", models, methods=["GET"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "ds4tools",
            "meta": {"n_ctx": state.n_ctx, "speculative": state.speculative}}


# --- generation ----------------------------------------------------------------------------------

class _Watch:
    """Reads a non-streaming job's events, checking every DISCONNECT_POLL_SECONDS that the
    client is still there; one that left cancels the job (its slot stops at the next token)."""

    def __init__(self, job: Job, request: Request):
        self.job, self.request = job, request
        self.checked = time.monotonic()
        self._get = None  # one get() kept across polls (wait_for's cancel could lose an event)

    async def _gone(self) -> bool:
        now = time.monotonic()
        if now - self.checked < DISCONNECT_POLL_SECONDS:
            return False
        self.checked = now
        return await self.request.is_disconnected()

    async def next(self):
        while True:
            if await self._gone():
                self.job.cancel()  # nginx's 499: nobody reads this answer, the metrics count it
                raise APIError(499, "the client closed the request", code="client_closed")
            if self._get is None:
                self._get = asyncio.ensure_future(self.job.events.get())
            done, _ = await asyncio.wait({self._get}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                item, self._get = self._get.result(), None
                return item

    def close(self) -> None:
        if self._get is not None:
            self._get.cancel()


async def _generate(state: ServerState, request: Request, req) -> Response:
    job = Job(req, asyncio.get_running_loop())
    try:
        state.pool.submit(job)
    except QueueFull:
        state.metrics.count_rejected()
        raise APIError(503, f"the server is busy: all {state.pool.slots} slots are generating and "
                            f"{state.pool.queue_size} requests wait; retry later",
                       type="server_error", code="server_busy",
                       headers={"Retry-After": str(state.retry_after)}) from None
    chat = req.kind == "chat"
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if req.stream:  # headers now: a client that leaves while its request waits is noticed too
        return StreamingResponse(_stream(job, req, rid, created), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    pieces = []
    watch = _Watch(job, request)
    try:
        while True:
            kind, value = await watch.next()
            if kind == "start":
                continue
            if kind == "text":
                pieces.append(value)
            elif kind == "error":
                raise value
            elif kind == "done":
                break
    except BaseException:
        job.cancel()
        watch.close()
        raise
    text = "".join(pieces)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": None, "finish_reason": value["finish_reason"]}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": value["finish_reason"]}
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": req.model, "system_fingerprint": None, "choices": [choice],
        "usage": value["usage"], "ds4tools": value["ds4tools"]})


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


async def _stream(job: Job, req, rid: str, created: int):
    chat = req.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text=None, finish=None, role=False, **extra):
        if chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        out = {"id": rid, "object": obj, "created": created, "model": req.model,
               "system_fingerprint": None, "choices": [choice]}
        if req.include_usage:
            out["usage"] = None
        out.update(extra)
        return _sse(out)

    try:
        if chat:
            yield chunk(text="", role=True)
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                yield chunk(text=value)
            elif kind == "error":  # the headers are sent: the error goes in the stream
                yield _sse(value.body())
                break
            elif kind == "done":
                yield chunk(text=None if chat else "", finish=value["finish_reason"],
                            **{"usage": value["usage"], "ds4tools": value["ds4tools"]})
                if req.include_usage:
                    yield _sse({"id": rid, "object": obj, "created": created, "model": req.model,
                                "system_fingerprint": None, "choices": [], "usage": value["usage"]})
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()  # the client went away (or we are done): the slot stops at the next token
