"""The OpenAI protocol as gemma-serve speaks it: request bodies and their fields validated,
errors in OpenAI's shape, and the response pieces (usage, choices, logprobs, SSE events).

Pure functions over dicts, the tokenizer and the engine's results: nothing here knows FastAPI,
the event loop or the engine thread (server.py holds those), so each rule can be read and
tested alone. A client's mistake is an ``APIError`` with its HTTP status, never anything else.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .chat_format import chat_ids
from .errors import InvalidRequestError
from .sampling import MAX_TOP_LOGPROBS, TokenLogprob

MAX_BODY = 1 << 20  # bytes; a larger request body gets 413


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str = ""):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {400: "invalid_request_error", 401: "invalid_api_key"}.get(status, "")
        self.headers: dict[str, str] = {}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        kind = "authentication_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def busy(message: str, retry_after: int) -> APIError:
    """A 503 that tells the client when to come back."""
    err = APIError(503, message)
    err.headers["Retry-After"] = str(retry_after)
    return err


# -- request parsing ------------------------------------------------------------------------
def _reject_constant(name: str) -> None:
    raise APIError(400, f"{name} is not valid JSON: send finite numbers only")


def parse_body(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_BODY:
        raise APIError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY}")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except APIError:
        raise
    except (ValueError, RecursionError) as err:
        raise APIError(400, f"request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "request body holds a lone surrogate (\\ud800-\\udfff)") from None
    return body


def field(body: dict, name: str, types: tuple, default: Any = None, lo=None, hi=None) -> Any:
    """``body[name]`` if it is one of ``types`` (a bool is not an int) within [lo, hi]; absent
    or null gives ``default``."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = "/".join(t.__name__ for t in types)
        raise APIError(400, f"{name} must be a {names}, got {type(value).__name__}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(400, f"{name} must be finite", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise APIError(400, f"{name} must be in [{lo}, {hi}], got {value}", name)
    return value


def check_model(body: dict, served_name: str) -> None:
    """Nothing in a request names a model to load: ``model`` must be the served name."""
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "model is required (a string)", "model")
    if model != served_name:
        raise APIError(
            404,
            f"model {model!r} is not served here; use {served_name!r}",
            "model",
            "model_not_found",
        )


def stream_options(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = field(body, "stream", (bool,), False)
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "stream_options must be an object", "stream_options")
    return stream, bool(opts.get("include_usage"))


def sampling_args(body: dict, ctx: int) -> dict[str, Any]:
    max_tokens = field(body, "max_completion_tokens", (int,), None, 1, ctx)
    max_tokens = field(body, "max_tokens", (int,), max_tokens or 16, 1, ctx)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop)
    ):
        raise APIError(400, "stop must be a string or a list of at most 4 strings", "stop")
    return dict(
        max_new_tokens=max_tokens,
        temperature=field(body, "temperature", (int, float), 1.0, 0, 2),
        top_p=field(body, "top_p", (int, float), None, 0, 1),
        top_k=field(body, "top_k", (int,), None, 1, None),
        seed=field(body, "seed", (int,), None, 0, 2**63 - 1),
        stop=stop or None,
    )


def logprobs_arg(body: dict, chat: bool) -> int | None:
    """How many alternatives to report per token, or None for no logprobs. Chat takes
    ``logprobs: true`` and ``top_logprobs: k``, completions ``logprobs: k`` (as OpenAI)."""
    if not chat:
        return field(body, "logprobs", (int,), None, 0, MAX_TOP_LOGPROBS)
    want = field(body, "logprobs", (bool,), False)
    top = field(body, "top_logprobs", (int,), None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if want else None


def prompt_param(chat: bool) -> str:
    """The field an error about the prompt names."""
    return "messages" if chat else "prompt"


def prompt_ids(body: dict, chat: bool, tokenizer: Any, model_type: str) -> list[int]:
    """The prompt's token ids: ``messages`` through the model's chat format, or ``prompt`` as
    a string or a list of token ids (the engine checks the ids against its vocabulary)."""
    try:
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list):
                raise APIError(400, "messages must be a list of messages", "messages")
            return chat_ids(tokenizer, model_type, msgs)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if not (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
            raise APIError(400, "prompt must be a string or a list of token ids", "prompt")
        return prompt
    except InvalidRequestError as err:
        raise APIError(400, str(err), prompt_param(chat)) from None


def check_fits(n_prompt: int, max_new_tokens: int, ctx: int, chat: bool) -> None:
    if n_prompt + max_new_tokens > ctx:
        raise APIError(
            400,
            f"the prompt has {n_prompt} tokens and max_tokens is {max_new_tokens}, "
            f"{n_prompt + max_new_tokens} in all, but the context holds {ctx}; shorten the "
            "prompt or lower max_tokens",
            prompt_param(chat),
            "context_length_exceeded",
        )


# -- responses ------------------------------------------------------------------------------
def usage(n_prompt: int, results: list[Any]) -> dict[str, Any]:
    """``usage`` over the n results of one request; they share the prompt (and its cache)."""
    out = sum(len(r.token_ids) for r in results)
    cached = results[0].stats.get("cached_tokens", 0) if results else 0
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": out,
        "total_tokens": n_prompt + out,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def choice(chat: bool, index: int, text: str, finish_reason: str, logprobs: Any) -> dict:
    """One choice of a non-streamed response."""
    c = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
    if chat:
        c["message"] = {"role": "assistant", "content": text}
    else:
        c["text"] = text
    return c


def chunk_choice(
    chat: bool,
    index: int,
    piece: str | None = None,
    finish: str | None = None,
    role: bool = False,
    logprobs: Any = None,
) -> dict:
    """One choice of a streamed chunk: chat's ``delta`` (the role in the first) or text."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else {}
        if piece is not None:
            delta["content"] = piece
        return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
    return {"index": index, "text": piece or "", "finish_reason": finish, "logprobs": logprobs}


def sse(payload: dict) -> str:
    """One server-sent event."""
    return "data: " + json.dumps(payload) + "\n\n"


DONE = "data: [DONE]\n\n"


# -- logprobs in OpenAI's shapes ------------------------------------------------------------
def _logprob(value: float) -> float:
    return max(value, -9999.0)  # as OpenAI: JSON has no -Infinity


def _token(tokenizer: Any, token: int) -> tuple[str, bytes]:
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), raw


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> dict[str, Any]:
    def one(token: int, logprob: float) -> dict[str, Any]:
        text, raw = _token(tokenizer, token)
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(raw)}

    return {
        "content": [
            {**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def completion_logprobs(
    tokenizer: Any, entries: list[TokenLogprob], offset: int = 0
) -> dict[str, Any]:
    """The legacy completions shape; ``text_offset`` counts characters from ``offset``."""
    tokens = [_token(tokenizer, e.token)[0] for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(e.logprob) for e in entries],
        "top_logprobs": [
            {_token(tokenizer, t)[0]: _logprob(lp) for t, lp in e.top} for e in entries
        ],
        "text_offset": offsets,
    }


def logprobs_body(
    tokenizer: Any, chat: bool, entries: list[TokenLogprob] | None, offset: int = 0
) -> dict[str, Any] | None:
    """``logprobs`` of a choice in the endpoint's shape, or None when none were asked for."""
    if entries is None:
        return None
    if chat:
        return chat_logprobs(tokenizer, entries)
    return completion_logprobs(tokenizer, entries, offset)
