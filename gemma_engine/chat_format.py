"""Chat messages -> prompt token ids, by each Gemma generation's template rules.

Turn markers are inserted by id and message text is encoded as plain text, so no message can
open or close a turn. Gemma 1-3n: ``<start_of_turn>user\\n...<end_of_turn>\\n``, assistant turns
are ``model`` turns, content is trimmed, and a leading system message goes at the head of the
first user turn followed by a blank line (Gemma 3's template; Gemma 1/2 have no system role and
get the same treatment). Gemma 4 has its own markers (``<|turn>``, ``<turn|>``) and a system role.
"""

from __future__ import annotations

from typing import Any

from .errors import InvalidRequestError

ROLES = ("system", "user", "assistant")


def chat_ids(tokenizer: Any, model_type: str, messages: list[dict[str, str]]) -> list[int]:
    """Ids of ``messages`` ([{"role", "content"}], system first if any, then user/assistant
    alternating from user), followed by the opening of the model's turn. A conversation that
    ends with an assistant message gets a new model turn after it, as the templates do."""
    if not messages:
        raise InvalidRequestError("messages is empty: give at least one user message")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise InvalidRequestError(
                f"messages[{i}] must be {{'role': one of {ROLES}, 'content': a string}}"
            )
    system = None
    if messages[0]["role"] == "system":
        system, messages = messages[0]["content"].strip(), messages[1:]
    for i, m in enumerate(messages):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            raise InvalidRequestError(
                "after an optional leading system message, roles must alternate user, "
                f"assistant, user, ...: message {i + (system is not None)} is {m['role']!r}"
            )
    if not messages:
        raise InvalidRequestError("messages holds only a system message: add a user message")

    def text(s: str) -> list[int]:
        return tokenizer.encode(s, add_bos=False)

    if model_type == "gemma4_text":
        start, end = tokenizer.special_id("<|turn>"), tokenizer.special_id("<turn|>")
    else:
        start, end = tokenizer.special_id("<start_of_turn>"), tokenizer.special_id("<end_of_turn>")
    ids = [tokenizer.bos_id]
    if system is not None and model_type == "gemma4_text":
        ids += [start, *text(f"system\n{system}"), end, *text("\n")]
        system = None
    for i, m in enumerate(messages):
        role = "user" if m["role"] == "user" else "model"
        content = m["content"].strip()
        if i == 0 and system is not None:
            content = f"{system}\n\n{content}"
        ids += [start, *text(f"{role}\n{content}"), end, *text("\n")]
    return [*ids, start, *text("model\n")]
