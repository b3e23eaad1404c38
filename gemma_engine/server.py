"""``gemma-serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

One process, one engine thread: it loads the model and then drives the scheduler for good
(``run_forever``), so the model runs on the thread that loaded it (scheduler.py says why).
Handlers only validate, ``submit`` and consume text pieces in worker threads, so the event
loop never blocks on the model. Nothing in a request names a file or model to load: ``model``
must equal the served name. The protocol itself (body and field rules, error and response
shapes) is openai_protocol.py; this file holds the app, its routes, the engine thread and main.
"""

import argparse
import asyncio
import hmac
import os
import threading
import time
import uuid
from typing import Any

from .errors import InvalidRequestError
from .openai_protocol import (
    DONE,
    APIError,
    busy,
    check_fits,
    check_model,
    choice,
    chunk_choice,
    error_body,
    field,
    logprobs_arg,
    logprobs_body,
    parse_body,
    prompt_ids,
    prompt_param,
    sampling_args,
    sse,
    stream_options,
    usage,
)


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
            raise busy("the server is shutting down", 5)
        if not worker.ready.is_set() or worker.engine is None:
            if worker.error is None:
                raise busy("the model is still loading", 5)
            raise busy(f"the model failed to load: {worker.error}", 5)
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
        check_model(body, served_name)
        n = field(body, "n", (int,), 1, 1, eng.max_batch * 4)
        stream, include_usage = stream_options(body)
        args = sampling_args(body, eng.max_seq_len)
        args["logprobs"] = logprobs_arg(body, chat)
        prompt = prompt_ids(body, chat, eng.tokenizer, eng.config.model_type)
        check_fits(len(prompt), args["max_new_tokens"], eng.max_seq_len, chat)
        if state["in_flight"] + n > eng.max_batch + max_queue:
            raise busy(f"the queue is full ({max_queue} waiting); retry later", 1)
        handles = []
        try:
            for i in range(n):
                seed = None if args["seed"] is None else args["seed"] + i
                handles.append(eng.submit(prompt, **{**args, "seed": seed}))
        except InvalidRequestError as err:
            for h in handles:
                h.cancel()
            raise APIError(400, str(err), prompt_param(chat)) from None
        return body, handles, stream, include_usage, len(prompt)

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

        def logprobs(entries, offset=0):
            return logprobs_body(tokenizer, chat, entries, offset)

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
            choices = [
                choice(chat, i, r.text, r.finish_reason, logprobs(r.logprobs))
                for i, r in enumerate(results)
            ]
            return {**head, "object": kind, "choices": choices, "usage": usage(n_prompt, results)}

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i, piece=None, finish=None, role=False, entries=None, offset=0):
            lp = logprobs(entries, offset) if entries else None
            c = chunk_choice(chat, i, piece, finish, role, lp)
            return sse({**head, "object": chunk_kind, "choices": [c]})

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
                    u = usage(n_prompt, [h.result() for h in handles])
                    yield sse({**head, "object": chunk_kind, "choices": [], "usage": u})
            except Exception as err:  # the stream has begun: the error goes in an event
                yield sse(error_body(500, f"generation failed: {err}"))
            finally:
                release()  # a client that hung up cancels its requests here
            yield DONE

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
    p.add_argument(
        "--kv-cache-dtype", default=None, help="float32, bfloat16 or float16 (default: the model's)"
    )
    p.add_argument("--quantize", choices=["none", "int8", "int4"], default=None)
    p.add_argument("--no-compile", action="store_true", help="run eagerly (no compile wait)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--cors-origin", default=None)
    p.add_argument("--max-queue", type=int, default=16)
    args = p.parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun every rank would serve
        print(
            "gemma-serve: error: the server runs in one process; tensor parallelism "
            "(torchrun) is for gemma-run and the Python API",
            file=sys.stderr,
        )
        return 2
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
            kv_cache_dtype=args.kv_cache_dtype,
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
