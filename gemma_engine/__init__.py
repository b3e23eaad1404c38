"""gemma-engine: Gemma inference in pure PyTorch, with a bucketed, compiled KV-cache decode."""

from .config import GemmaConfig
from .engine import Engine, Generation
from .errors import (
    CheckpointError,
    CheckpointNotFoundError,
    GemmaEngineError,
    InvalidRequestError,
    OutOfMemoryError,
    UnsupportedModelError,
)
from .request import Request
from .tokenizer import Tokenizer

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "Engine",
    "GemmaConfig",
    "GemmaEngineError",
    "Generation",
    "InvalidRequestError",
    "OutOfMemoryError",
    "Request",
    "Tokenizer",
    "UnsupportedModelError",
]
