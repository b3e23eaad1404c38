"""``gemma-serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

One process, one engine thread: it loads the model and then drives the scheduler for good
(``run_forever``), so the model runs on the thread that loaded it (scheduler.py says why).
Handlers only validate, ``submit`` and consume text pieces in worker threads, so the event
loop never blocks on the model. Nothing in a request names a file or model to load: ``model``
must equal the served name.
"""

import argparse
import asyncio
import hmac
import json
import math
import threading
import time
import uuid
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


class EngineThread(threading.Thread):
    """Loads the engine and drives it until ``stop`` is set; ``ready`` once loaded."""

    def __init__(self, load: Any) -> None:
        super().__init__(name="gemma-engine", daemon=True)
        self.load, self.engine, self.error = load, None, None
        self.ready, self.stop = threading.Event(), threading.Event()

    def run(self) -> None:
        try:
            self.engine = self.load()
        except BaseException as err:  # reported by /health and at startup
            self.error = err
            self.ready.set()
            return
        self.ready.set()
        self.engine.scheduler.run_forever(self.stop)


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


def _field(body: dict, name: str, types: tuple, default: Any = None, lo=None, hi=None) -> Any:
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


def sampling_args(body: dict, ctx: int) -> dict[str, Any]:
    max_tokens = _field(body, "max_completion_tokens", (int,), None, 1, ctx)
    max_tokens = _field(body, "max_tokens", (int,), max_tokens or 16, 1, ctx)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop)
    ):
        raise APIError(400, "stop must be a string or a list of at most 4 strings", "stop")
    return dict(
        max_new_tokens=max_tokens,
        temperature=_field(body, "temperature", (int, float), 1.0, 0, 2),
        top_p=_field(body, "top_p", (int, float), None, 0, 1),
        top_k=_field(body, "top_k", (int,), None, 1, None),
        seed=_field(body, "seed", (int,), None, 0, 2**63 - 1),
        stop=stop or None,
    )


def logprobs_arg(body: dict, chat: bool) -> int | None:
    """How many alternatives to report per token, or None for no logprobs. Chat takes
    ``logprobs: true`` and ``top_logprobs: k``, completions ``logprobs: k`` (as OpenAI)."""
    if not chat:
        return _field(body, "logprobs", (int,), None, 0, MAX_TOP_LOGPROBS)
    want = _field(body, "logprobs", (bool,), False)
    top = _field(body, "top_logprobs", (int,), None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if want else None


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


# -- the app --------------------------------------------------------------------------------
def create_app(
    load: Any,
    *,
    served_name: str,
    api_key: str | None = None,
    cors_origin: str | None = None,
    max_queue: int = 16,
    drain_seconds: float = 30.0,
):
    """The FastAPI app; ``load()`` builds the Engine on the engine thread at startup."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    from .server_metrics import CONTENT_TYPE, ServerMetrics

    state: dict[str, Any] = {"in_flight": 0, "closing": False}
    worker = EngineThread(load)
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        state["closing"] = True  # uvicorn stops accepting; drain what runs, then stop
        deadline = time.monotonic() + drain_seconds
        while state["in_flight"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        worker.stop.set()
        worker.join(timeout=10)

    app = FastAPI(title="gemma-serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker = worker
    app.state.metrics = metrics
    if cors_origin:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware, allow_origins=[cors_origin], allow_methods=["*"], allow_headers=["*"]
        )

    @app.exception_handler(APIError)
    async def _api_error(request, err: APIError):
        headers = dict(err.headers)
        return JSONResponse(
            error_body(err.status, err.message, err.param, err.code or None),
            err.status,
            headers=headers,
        )

    @app.exception_handler(Exception)
    async def _server_error(request, err: Exception):
        # Client input never gets here (it is an APIError); this is the server's own fault.
        return JSONResponse(error_body(500, f"internal error: {err}"), 500)

    @app.exception_handler(404)
    async def _not_found(request, err):
        return JSONResponse(error_body(404, f"no route {request.url.path}"), 404)

    @app.exception_handler(405)
    async def _bad_method(request, err):
        return JSONResponse(error_body(405, f"{request.method} not allowed here"), 405)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            want = f"Bearer {api_key}"
            if not hmac.compare_digest(given.encode(), want.encode()):
                body = error_body(401, "missing or wrong API key (Authorization: Bearer KEY)")
                return JSONResponse(body, 401)
        response = await call_next(request)
        if request.url.path.startswith("/v1/"):
            metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    def engine():
        if state["closing"]:
            err = APIError(503, "the server is shutting down")
            err.headers["Retry-After"] = "5"
            raise err
        if not worker.ready.is_set() or worker.engine is None:
            err = APIError(
                503,
                "the model is still loading"
                if worker.error is None
                else f"the model failed to load: {worker.error}",
            )
            err.headers["Retry-After"] = "5"
            raise err
        return worker.engine

    @app.get("/health")
    async def health():
        if worker.engine is None or state["closing"]:
            msg = "loading" if worker.error is None else f"load failed: {worker.error}"
            return JSONResponse({"status": "closing" if state["closing"] else msg}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(worker.engine), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {"id": served_name, "object": "model", "created": 0, "owned_by": "gemma-engine"}
            ],
        }

    async def read(request: Request, chat: bool):
        raw = await request.body()
        body = parse_body(raw)
        eng = engine()
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
        n = _field(body, "n", (int,), 1, 1, eng.max_batch * 4)
        stream = _field(body, "stream", (bool,), False)
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise APIError(400, "stream_options must be an object", "stream_options")
        args = sampling_args(body, eng.max_seq_len)
        args["logprobs"] = logprobs_arg(body, chat)
        try:
            if chat:
                msgs = body.get("messages")
                if not isinstance(msgs, list):
                    raise APIError(400, "messages must be a list of messages", "messages")
                prompt = chat_ids(eng.tokenizer, eng.config.model_type, msgs)
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    prompt = eng.tokenizer.encode(prompt)
                elif not (isinstance(prompt, list) and all(type(t) is int for t in prompt)):
                    raise APIError(400, "prompt must be a string or a list of token ids", "prompt")
        except InvalidRequestError as err:
            raise APIError(400, str(err), "messages" if chat else "prompt") from None
        if len(prompt) + args["max_new_tokens"] > eng.max_seq_len:
            raise APIError(
                400,
                f"the prompt has {len(prompt)} tokens and max_tokens is "
                f"{args['max_new_tokens']}, {len(prompt) + args['max_new_tokens']} in all, but "
                f"the context holds {eng.max_seq_len}; shorten the prompt or lower max_tokens",
                "messages" if chat else "prompt",
                "context_length_exceeded",
            )
        if state["in_flight"] + n > eng.max_batch + max_queue:
            err = APIError(503, f"the queue is full ({max_queue} waiting); retry later")
            err.headers["Retry-After"] = "1"
            raise err
        handles = []
        try:
            for i in range(n):
                seed = None if args["seed"] is None else args["seed"] + i
                handles.append(eng.submit(prompt, **{**args, "seed": seed}))
        except InvalidRequestError as err:
            for h in handles:
                h.cancel()
            raise APIError(400, str(err), "messages" if chat else "prompt") from None
        return body, handles, stream, bool(opts.get("include_usage")), len(prompt)

    async def complete(request: Request, chat: bool):
        body, handles, stream, usage_chunk, n_prompt = await read(request, chat)
        tokenizer = worker.engine.tokenizer
        state["in_flight"] += len(handles)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        head = {"id": rid, "created": created, "model": served_name}
        # The engine's thread wakes this event loop when it queues text for these requests,
        # so that waiting takes no thread (see Request.ready).
        loop, update = asyncio.get_running_loop(), asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(update.set)
            except RuntimeError:  # the loop has closed (shutdown): nobody is waiting
                pass

        for h in handles:
            h.on_update = wake

        def usage(results):
            out = sum(len(r.token_ids) for r in results)
            cached = results[0].stats.get("cached_tokens", 0) if results else 0
            return {
                "prompt_tokens": n_prompt,
                "completion_tokens": out,
                "total_tokens": n_prompt + out,
                "prompt_tokens_details": {"cached_tokens": cached},
            }

        def logprobs(entries, offset=0):
            if entries is None:
                return None
            if chat:
                return chat_logprobs(tokenizer, entries)
            return completion_logprobs(tokenizer, entries, offset)

        released = False

        def release():
            nonlocal released
            if released:
                return
            released = True
            state["in_flight"] -= len(handles)
            for h in handles:
                h.cancel()  # no-op once done
                h.on_update = None
                metrics.ended(h)

        if not stream:
            # The body has been read, so the next message is the client hanging up.
            gone = asyncio.ensure_future(request.receive())
            try:
                while True:
                    update.clear()
                    if all(h.done for h in handles):
                        break
                    if gone.done():
                        return Response(status_code=499)  # nobody reads it; frees the slots
                    woken = asyncio.ensure_future(update.wait())
                    await asyncio.wait({gone, woken}, return_when=asyncio.FIRST_COMPLETED)
                    woken.cancel()
                try:
                    results = [h.result() for h in handles]
                except Exception as err:  # the engine failed, not the request
                    raise APIError(500, f"generation failed: {err}") from err
            finally:
                gone.cancel()
                release()
            choices = []
            for i, r in enumerate(results):
                c = {"index": i, "finish_reason": r.finish_reason, "logprobs": logprobs(r.logprobs)}
                if chat:
                    c["message"] = {"role": "assistant", "content": r.text}
                else:
                    c["text"] = r.text
                choices.append(c)
            return {**head, "object": kind, "choices": choices, "usage": usage(results)}

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i, piece=None, finish=None, role=False, entries=None, offset=0):
            lp = logprobs(entries, offset) if entries else None
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {}
                if piece is not None:
                    delta["content"] = piece
                c = {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}
            else:
                c = {"index": i, "text": piece or "", "finish_reason": finish, "logprobs": lp}
            return "data: " + json.dumps({**head, "object": chunk_kind, "choices": [c]}) + "\n\n"

        async def events():
            try:
                for i, h in enumerate(handles):  # n > 1: choices one after the other
                    if chat:
                        yield chunk(i, role=True)
                    sent, offset = 0, 0  # tokens whose logprobs went out; text so far
                    while True:
                        update.clear()
                        pieces, ended = h.ready()
                        for piece, n_tokens in pieces:
                            entries = h.logprobs[sent:n_tokens] if h.logprobs is not None else None
                            yield chunk(i, piece, entries=entries, offset=offset)
                            sent, offset = n_tokens, offset + len(piece)
                        if ended:
                            break
                        await update.wait()
                    result = h.result()  # raises the engine's error, if it failed
                    rest = result.logprobs[sent:] if result.logprobs is not None else None
                    yield chunk(i, finish=result.finish_reason, entries=rest, offset=offset)
                if usage_chunk:
                    u = usage([h.result() for h in handles])
                    yield (
                        "data: "
                        + json.dumps({**head, "object": chunk_kind, "choices": [], "usage": u})
                        + "\n\n"
                    )
            except Exception as err:  # the stream has begun: the error goes in an event
                message = f"generation failed: {err}"
                yield "data: " + json.dumps(error_body(500, message)) + "\n\n"
            finally:
                release()  # a client that hung up cancels its requests here
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(prog="gemma-serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="folder, .gguf file or hub id (default model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--max-seq-len", type=int, default=None)
    p.add_argument("--quantize", choices=["none", "int8", "int4"], default=None)
    p.add_argument("--no-compile", action="store_true", help="run eagerly (no compile wait)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--cors-origin", default=None)
    p.add_argument("--max-queue", type=int, default=16)
    args = p.parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print(
            "gemma-serve: install the serve extra: pip install 'gemma-engine[serve]'",
            file=sys.stderr,
        )
        return 2
    from .engine import Engine

    def load():
        return Engine.from_pretrained(
            args.model,
            max_batch=args.max_batch,
            max_seq_len=args.max_seq_len,
            quantize=args.quantize,
            compile=not args.no_compile,
        )

    name = args.served_model_name or (str(args.model) if args.model else "gemma-3-270m")
    app = create_app(
        load,
        served_name=name,
        api_key=args.api_key,
        cors_origin=args.cors_origin,
        max_queue=args.max_queue,
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=30
    )
    _server_class()(config).run()
    return 0


def _server_class():
    import contextlib
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its shutdown (the exit status is then -15); this one
        drains (lifespan shutdown) and returns, so the process exits 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            def stop(sig, frame):
                self.should_exit = True

            old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)

    return Server


if __name__ == "__main__":
    raise SystemExit(main())
