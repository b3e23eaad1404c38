"""Exceptions raised at the edges of the engine.

Every error a user can cause is one of these, with a message that says what is
wrong and what to do. They subclass the built-in exception a caller would
expect (``ValueError``, ``FileNotFoundError``) so that generic handlers work.
"""


class GemmaEngineError(Exception):
    """Base class: the CLI prints these as one line and exits 2."""


class CheckpointError(GemmaEngineError, ValueError):
    """A checkpoint folder or file is missing pieces, malformed, or unsafe."""


class CheckpointNotFoundError(GemmaEngineError, FileNotFoundError):
    """A model folder, file or hub id could not be found."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is not a Gemma text model this engine implements (a CheckpointError:
    whoever handles a bad checkpoint handles this one too)."""


class InvalidRequestError(GemmaEngineError, ValueError):
    """A generation request is invalid: bad sampling values, prompt too long."""


class OutOfMemoryError(GemmaEngineError, MemoryError):
    """The KV cache or the weights do not fit in the memory available."""
