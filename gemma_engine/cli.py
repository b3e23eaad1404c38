"""gemma-run: a thin command line over Engine.generate."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from .errors import GemmaEngineError, InvalidRequestError
from .parallel import launched_rank

# A prompt is at most max_seq_len tokens (a few bytes each); more than this is not a prompt.
MAX_PROMPT_BYTES = 64 << 20


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        self.exit(2, f"gemma-run: error: {message} (see gemma-run --help)\n")


def _bucket_list(text: str) -> list[int]:
    return [int(b) for b in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gemma-run", description="Generate text with a Gemma model.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text, or - to read stdin (UTF-8)")
    source.add_argument("--prompt-file", help="a UTF-8 text file holding the prompt")
    source.add_argument(
        "--precompile",
        action="store_true",
        help="instead of generating, build the decode graphs of the first two buckets (or of "
        "--buckets) for one sequence and keep them in the compile cache for later runs",
    )
    p.add_argument(
        "--model",
        help="checkpoint folder, .gguf file or hub id "
        "(default: Gemma 3 270M in weights/gemma-3-270m)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop when this text appears (repeatable)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: fp32 CPU, bf16 CUDA)")
    p.add_argument("--max-seq-len", type=int, help="KV cache length in tokens")
    p.add_argument(
        "--kv-cache-dtype",
        help="float32, bfloat16 or float16: the KV cache's dtype (default: the model's)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=1,
        help="sequences the cache holds at once (default: 1, the one prompt gemma-run decodes)",
    )
    p.add_argument(
        "--buckets",
        type=_bucket_list,
        help="comma-separated decode bucket lengths (default: powers of two from 256)",
    )
    p.add_argument(
        "--quantize",
        choices=["none", "int8", "int4"],
        help="weight-only quantization at load time (default: none, or as saved)",
    )
    p.add_argument("--group-size", type=int, help="int4 group size (default: 32 where it fits)")
    p.add_argument("--no-compile", action="store_true", help="run eagerly, without torch.compile")
    p.add_argument(
        "--no-greedy-screen",
        action="store_true",
        help="greedy steps read the whole float output layer, not its int8 copy first (the "
        "same tokens, slower; see greedy_screen.py)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt in the model's chat turn template (Gemma 4's <|turn> markers, "
        "or <start_of_turn> for Gemma 1-3n); stop at the end of the turn",
    )
    p.add_argument("--system", help="a system prompt for --chat")
    p.add_argument(
        "--speculate",
        choices=["none", "lookup", "int8"],
        help="speculative decoding, same output: draft tokens from the prompt and output "
        "(lookup) or with an int8 copy of the model (int8), check them in one step",
    )
    p.add_argument(
        "--speculate-tokens", type=int, help="tokens drafted per step with --speculate (default 4)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    dist = sys.modules.get("torch.distributed")  # (an early error never imported torch)
    if dist is not None and dist.is_available() and dist.is_initialized():
        # A rank leaves without tearing down gloo/NCCL: left to the interpreter's exit, that
        # teardown sometimes aborted a rank whose peer had already gone (exit -6 after a
        # finished run, about 1 run in 4 under torchrun on this project's 2-core VM).
        _leave(code)
    return code


def command() -> None:
    """The ``gemma-run`` command: main(), then leave at once. The interpreter's teardown of
    torch and inductor took ~0.9 s after the last token on this project's 2-core VM; gemma-run
    has flushed its output and written its files (atomically, as it went) by then."""
    _leave(main())


def _leave(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe (gemma-run | head)
            stream.flush()
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    if launched_rank() != 0:  # torchrun: every rank runs this; only rank 0 prints
        _silence()
    args = _parser().parse_args(argv)
    if args.system is not None and not args.chat:
        _parser().error("--system needs --chat")
    if args.speculate_tokens is not None and args.speculate in (None, "none"):
        _parser().error("--speculate-tokens needs --speculate lookup or int8")
    if args.precompile and args.no_compile:
        _parser().error("--precompile builds compiled graphs: drop --no-compile")
    printed = False
    try:
        prompt = None if args.precompile else _read_prompt(args.prompt, args.prompt_file)
        from .engine import Engine

        engine = Engine.from_pretrained(
            args.model,
            device=args.device,
            dtype=args.dtype,
            max_seq_len=args.max_seq_len,
            max_batch=args.max_batch,
            compile=not args.no_compile,
            buckets=args.buckets,
            quantize=args.quantize,
            group_size=args.group_size,
            speculate=args.speculate,
            speculate_tokens=args.speculate_tokens,
            greedy_screen=False if args.no_greedy_screen else None,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        at_line_start = True

        def tell(text: str) -> None:  # a graph compiles: say so on a line of its own
            sys.stdout.flush()
            print(("" if at_line_start else "\n") + f"gemma-run: {text}", file=sys.stderr)
            sys.stderr.flush()

        engine.on_compile = tell
        if args.precompile:
            return _precompile(engine, args.buckets, greedy=args.temperature == 0)
        request = engine.chat_prompt(prompt, system=args.system) if args.chat else prompt
        start = time.perf_counter()
        first = None
        run = engine.stream(
            request,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop,
        )
        for piece in run:
            first = first or time.perf_counter() - start
            sys.stdout.write(piece)
            sys.stdout.flush()
            printed = True
            at_line_start = piece.endswith("\n")
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(_summary(engine.last_stats, first, engine.quantization), file=sys.stderr)
        return 0
    except GemmaEngineError as err:
        if printed:
            sys.stdout.write("\n")
        message = " ".join(str(err).split())  # one line, whatever the message holds
        print(f"gemma-run: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        return 130
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        sys.stderr.close()
        return 0


def _precompile(engine, buckets: list[int] | None, greedy: bool) -> int:
    start = time.perf_counter()
    built = engine.precompile(buckets, greedy=greedy)
    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "TorchInductor's cache")
    spec = engine.speculator
    also = "" if spec is None else f" (with --speculate {spec.method}'s for {spec.k} drafts)"
    print(
        f"gemma-run: decode graphs{also} ready for 1 sequence and kv buckets "
        f"{', '.join(map(str, built))} in {time.perf_counter() - start:.1f} s; "
        f"kept in {where} for later runs",
        file=sys.stderr,
    )
    return 0


def _silence() -> None:
    """Send this process's stdout and stderr (Python's and the C libraries') to /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)


def _read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt: the --prompt text, stdin for "-", or a file; bytes must be UTF-8 text."""
    if prompt is not None and prompt != "-":
        return prompt
    if prompt is not None:
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:  # a text stream put in place of stdin (tests, embedding)
            return sys.stdin.read(MAX_PROMPT_BYTES)
        data, where = stream.read(MAX_PROMPT_BYTES + 1), "stdin"
    else:
        where = prompt_file
        try:
            with open(prompt_file, "rb") as f:
                data = f.read(MAX_PROMPT_BYTES + 1)
        except IsADirectoryError:
            raise InvalidRequestError(
                f"--prompt-file {where} is a folder, not a text file"
            ) from None
        except OSError as err:
            raise InvalidRequestError(
                f"cannot read --prompt-file {where}: {err.strerror or err}"
            ) from None
    if len(data) > MAX_PROMPT_BYTES:
        raise InvalidRequestError(f"the prompt from {where} is over {MAX_PROMPT_BYTES:,} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidRequestError(
            f"the prompt from {where} is not UTF-8 text (byte {data[err.start]:#04x} at offset "
            f"{err.start}); convert it to UTF-8 first (e.g. iconv -t UTF-8)"
        ) from None
    if "\0" in text:
        raise InvalidRequestError(f"the prompt from {where} holds NUL bytes; it is not text")
    return text


def _summary(stats: dict, first_token_seconds: float | None, quantization) -> str:
    rate = stats.get("decode_tokens_per_second")
    compiled = stats.get("buckets_compiled") or []
    parts = [
        f"{stats['prompt_tokens']} prompt tokens",
        f"first token {first_token_seconds:.2f} s" if first_token_seconds else "no text",
        f"decode {rate:.1f} tok/s ({stats['decode_tokens']} tokens)" if rate else "no decode steps",
        # (built or loaded: the graph lines above say which)
        f"graphs ready for buckets {', '.join(map(str, compiled))} in "
        f"{stats['compile_seconds']:.1f} s"
        if compiled
        else "no new graphs",
    ]
    if stats.get("drafted_tokens"):
        kept, drafted = stats["accepted_tokens"], stats["drafted_tokens"]
        parts.insert(3, f"drafts kept {kept}/{drafted} ({kept / drafted:.0%})")
    if quantization:
        method, group = quantization
        parts.insert(0, f"{method} weights" + (f" (groups of {group})" if group else ""))
    return "gemma-run: " + "; ".join(parts)


if __name__ == "__main__":
    command()
