"""Request bodies of /v1/completions and /v1/chat/completions: checked field by field into a
``GenRequest``; anything wrong is an ``APIError`` 400 naming the field (never a crash).

Defaults are OpenAI's: temperature 1, top_p 1 (no top-k, no min-p unless given, as llama.cpp's
server extensions ``top_k`` / ``min_p``); max_tokens 16 for completions, the rest of the context
for chat. ``ignore_eos`` (llama.cpp's extension) keeps generating past end-of-generation tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import bad_request

#: the most stop sequences a request may give
MAX_STOP = 16
#: OpenAI's default max_tokens of the legacy completions endpoint
DEFAULT_COMPLETION_TOKENS = 16


@dataclass
class GenRequest:
    kind: str                      # "completion" | "chat"
    model: str
    prompt: str                    # the text the engine continues (chat: the rendered template)
    prompt_tokens: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


# --- typed getters -----------------------------------------------------------------------------

def _get(body: dict, name: str, kinds, default=None, *, what: str, nullable: bool = True):
    v = body.get(name, default)
    if v is None:
        if not nullable and name in body:
            raise bad_request(f"'{name}' must be {what}, not null", name, "invalid_type")
        return default
    # bool is an int in Python: never accept true/false where a number is asked for
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise bad_request(f"'{name}' must be {what}, got {type(v).__name__} {_short(v)}",
                          name, "invalid_type")
    return v


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _number(body, name, default, lo, hi, *, lo_open=False):
    v = _get(body, name, (int, float), default, what="a number")
    v = float(v)
    if not math.isfinite(v) or v < lo or (lo_open and v <= lo) or v > hi:
        lo_s = f"({lo}" if lo_open else f"[{lo}"
        raise bad_request(f"'{name}' must be in {lo_s}, {hi}], got {v}", name, "invalid_value")
    return v


def _int(body, name, default, lo, hi=None):
    v = _get(body, name, (int,), default, what="an integer")
    if v is None:
        return None
    if v < lo or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"'{name}' must be {bounds}, got {v}", name, "invalid_value")
    return v


def _stop(body) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(v) > MAX_STOP:
        raise bad_request(f"'stop' has {len(v)} sequences; at most {MAX_STOP}", "stop", "invalid_value")
    if any(s == "" for s in v):
        raise bad_request("'stop' sequences must not be empty", "stop", "invalid_value")
    return list(v)


def _common(body: dict, kind: str, server) -> dict:
    """The sampling and stream fields both endpoints share."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    model = _get(body, "model", (str,), None, what="a string")
    if model is not None and model not in server.model_names:
        raise bad_request(f"the model '{model}' does not exist; this server serves "
                          f"'{server.model_id}' (GET /v1/models)", "model", "model_not_found")
    n = _int(body, "n", 1, 1)
    if n != 1:
        raise bad_request("'n' must be 1: one choice per request", "n", "invalid_value")
    seed = _get(body, "seed", (int,), None, what="an integer")
    if seed is not None and seed < 0 and seed != -1:
        raise bad_request(f"'seed' must be -1 (random) or a non-negative integer, got {seed}",
                          "seed", "invalid_value")
    if seed is not None and seed >= 2 ** 64:
        raise bad_request(f"'seed' must be below 2**64, got {seed}", "seed", "invalid_value")
    stream = _get(body, "stream", (bool,), False, what="a boolean")
    opts = _get(body, "stream_options", (dict,), None, what="an object")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed with 'stream': true",
                              "stream_options", "invalid_value")
        include_usage = _get(opts, "include_usage", (bool,), False, what="a boolean")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    if temperature > 0 and server.greedy_only:
        raise bad_request("this server drafts with --dspark-strict, lossless only at temperature 0: "
                          "send \"temperature\": 0", "temperature", "invalid_value")
    return dict(
        model=server.model_id,
        temperature=temperature,
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_int(body, "top_k", 0, 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=None if seed == -1 else seed,
        stop=_stop(body),
        stream=stream, include_usage=include_usage,
        ignore_eos=_get(body, "ignore_eos", (bool,), False, what="a boolean"),
    )


def _max_tokens(body: dict, names, prompt_tokens: int, n_ctx: int, default: int | None) -> int:
    """The request's max_tokens, which with the prompt must fit in the context."""
    if prompt_tokens > n_ctx:
        raise bad_request(f"the prompt is {prompt_tokens} tokens, longer than the context of "
                          f"{n_ctx} tokens", "messages" if "max_completion_tokens" in names else "prompt",
                          "context_length_exceeded")
    value, name = None, names[0]
    for nm in names:
        v = _int(body, nm, None, 1)
        if v is not None:
            value, name = v, nm
            break
    room = n_ctx - prompt_tokens
    if value is None:
        value = room if default is None else min(default, room)
        if value < 1:
            raise bad_request(f"the prompt ({prompt_tokens} tokens) fills the context of {n_ctx} "
                              f"tokens: no room to generate", name, "context_length_exceeded")
    elif value > room:
        raise bad_request(f"'{name}' is {value}, but the prompt is {prompt_tokens} tokens and the "
                          f"context {n_ctx}: at most {room}", name, "context_length_exceeded")
    return value


def parse_completion(body, server) -> GenRequest:
    """POST /v1/completions: ``prompt`` a string (or a list holding one string)."""
    common = _common(body, "completion", server)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (token-id prompts and batches of prompts are "
                          "not supported)", "prompt", "invalid_type")
    if prompt == "":
        raise bad_request("'prompt' is empty", "prompt", "invalid_value")
    if body.get("echo"):
        raise bad_request("'echo' is not supported", "echo", "unsupported_parameter")
    n_prompt = server.count_tokens(prompt)
    if n_prompt == 0:
        raise bad_request("the prompt gives no tokens", "prompt", "invalid_value")
    max_tokens = _max_tokens(body, ("max_tokens",), n_prompt, server.n_ctx, DEFAULT_COMPLETION_TOKENS)
    return GenRequest("completion", prompt=prompt, prompt_tokens=n_prompt, max_tokens=max_tokens,
                      **common)


def _content(msg: dict, i: int) -> str | None:
    c = msg.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: only text ones
        parts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts "
                                  "({\"type\": \"text\", \"text\": ...}) are supported",
                                  f"messages[{i}].content", "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                      f"messages[{i}].content", "invalid_type")


def parse_messages(body) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise bad_request("'messages' must be a list of messages", "messages", "invalid_type")
    if not msgs:
        raise bad_request("'messages' is empty", "messages", "invalid_value")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"messages[{i}].role must be a non-empty string", f"messages[{i}].role",
                              "invalid_type")
        msg = dict(m)
        msg["content"] = _content(m, i)
        out.append(msg)
    return out


def parse_chat(body, server) -> GenRequest:
    """POST /v1/chat/completions: ``messages`` rendered with the model's chat template."""
    common = _common(body, "chat", server)
    messages = parse_messages(body)
    if server.template is None:
        raise bad_request("this model has no chat template (tokenizer.chat_template); use "
                          "/v1/completions, or start the server with --chat-template-file FILE",
                          "messages", "no_chat_template")
    tools = _get(body, "tools", (list,), None, what="a list")
    prompt = server.template.render(messages, tools=tools)
    n_prompt = server.count_tokens(prompt)
    if n_prompt == 0:
        raise bad_request("the rendered chat prompt gives no tokens", "messages", "invalid_value")
    max_tokens = _max_tokens(body, ("max_completion_tokens", "max_tokens"), n_prompt, server.n_ctx, None)
    return GenRequest("chat", prompt=prompt, prompt_tokens=n_prompt, max_tokens=max_tokens, **common)
