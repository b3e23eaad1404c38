"""``gemma-chat``: an interactive terminal chat over the engine.

The history is kept as messages and each turn's prompt is the whole conversation by ids
(chat_format.py); the engine's prefix reuse then prefills only the new turn. Ctrl-C stops the
reply being written and keeps the session; Ctrl-D or ``/exit`` leaves; ``/reset`` forgets the
history; ``/system TEXT`` sets a system prompt (and starts over).
"""

from __future__ import annotations

import argparse
import sys

from .chat_format import chat_ids
from .errors import GemmaEngineError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gemma-chat", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="folder, .gguf file or hub id (default model)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--quantize", choices=["none", "int8", "int4"], default=None)
    p.add_argument("--no-compile", action="store_true", help="run eagerly (no compile wait)")
    p.add_argument("--stats", action="store_true", help="after each reply: prompt/cached tokens")
    args = p.parse_args(argv)
    from .engine import Engine

    try:
        engine = Engine.from_pretrained(
            args.model, quantize=args.quantize, compile=not args.no_compile, max_batch=1
        )
    except GemmaEngineError as err:
        print(f"gemma-chat: {err}", file=sys.stderr)
        return 2
    system: str | None = None
    history: list[dict[str, str]] = []
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = []
            print("(history cleared)")
            continue
        if line.startswith("/system"):
            system = line[len("/system") :].strip() or None
            history = []
            print("(system prompt set; history cleared)" if system else "(system prompt removed)")
            continue
        if not line.strip():
            continue
        turn = [*history, {"role": "user", "content": line}]
        messages = ([{"role": "system", "content": system}] if system else []) + turn
        try:
            ids = chat_ids(engine.tokenizer, engine.config.model_type, messages)
            request = engine.submit(
                ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature
            )
        except GemmaEngineError as err:
            print(f"gemma-chat: {err}", file=sys.stderr)
            continue
        try:
            for piece in request:
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            request.cancel()
            print(" [stopped]", end="")
        print()
        try:
            result = request.result()
        except BaseException:  # Ctrl-C landed inside a model step: that turn is dropped
            continue
        history = [*turn, {"role": "assistant", "content": result.text}]
        if args.stats:
            s = result.stats
            print(f"[prompt {s['prompt_tokens']} tokens, cached {s['cached_tokens']}]")


if __name__ == "__main__":
    raise SystemExit(main())
