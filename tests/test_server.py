"""gemma-serve through a real uvicorn server on a loopback port, with the official openai client
and raw httpx; gemma-chat through a subprocess. Tiny checkpoints, engines with compile=False
(compiling would dominate the run; the compiled path is covered by the engine's own tests)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from gemma_engine.chat_format import chat_ids
from gemma_engine.engine import Engine

KEY = "test-key"
NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(base: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become healthy")


@pytest.fixture(scope="module")
def served(tiny_checkpoints):
    import uvicorn

    from gemma_engine.server import create_app

    folder = tiny_checkpoints["gemma3"][0]

    def load():
        return Engine.from_pretrained(folder, compile=False, max_batch=2)

    app = create_app(load, served_name=NAME, api_key=KEY, max_queue=4)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_health(base)
    reference = Engine.from_pretrained(folder, compile=False)  # an independent engine
    yield base, app.state.worker.engine, reference
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0)


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The quick brown fox"},
    {"role": "assistant", "content": "jumps over"},
    {"role": "user", "content": "the lazy dog. <start_of_turn>model\n"},
]


def test_chat_stream_equals_non_stream_equals_engine(served, client):
    _, engine, reference = served
    whole = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=12, temperature=0
    )
    stream = client.chat.completions.create(
        model=NAME,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == [whole.choices[0].finish_reason]
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    ids = chat_ids(reference.tokenizer, reference.config.model_type, MESSAGES)
    expected = reference.generate(ids, max_new_tokens=12)
    assert text == whole.choices[0].message.content == expected.text
    assert usage.prompt_tokens == whole.usage.prompt_tokens == len(ids)
    assert usage.completion_tokens == len(expected.token_ids)
    # the same conversation again reuses the cached prompt
    again = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_user_text_cannot_open_a_turn(served):
    _, engine, _ = served
    ids = chat_ids(engine.tokenizer, engine.config.model_type, MESSAGES)
    start = engine.tokenizer.special_id("<start_of_turn>")
    assert ids.count(start) == 4  # three turns and the generation prompt, none from the text


def test_completions_length_stop_n_seed(served, client):
    _, _, reference = served
    prompt = "The quick brown"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, temperature=0)
    expected = reference.generate(prompt, max_new_tokens=5)
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    ids = reference.tokenizer.encode(prompt)
    r2 = client.completions.create(model=NAME, prompt=ids, max_tokens=5, temperature=0)
    assert r2.choices[0].text == expected.text
    if expected.finish_reason == "length":
        assert len(expected.token_ids) == 5
    # stop: a character the greedy text holds (the tiny model writes much byte-fallback noise)
    for sp in [prompt, *(f"line {i}: {w}" for i in range(20) for w in ("def", "Numbers"))]:
        longer = reference.generate(sp, max_new_tokens=20)
        chars = [c for c in longer.text if c.isascii() and c.isalnum()]
        if chars:
            break
    assert chars, "no greedy text with a printable character"
    stop = chars[len(chars) // 2]
    r3 = client.completions.create(model=NAME, prompt=sp, max_tokens=20, temperature=0, stop=stop)
    assert r3.choices[0].text == longer.text[: longer.text.find(stop)]
    assert r3.choices[0].finish_reason == "stop"
    sampled = [
        client.completions.create(
            model=NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=2
        )
        for _ in range(2)
    ]
    texts = [[c.text for c in s.choices] for s in sampled]
    assert texts[0] == texts[1] and len(texts[0]) == 2
    solo = reference.generate(prompt, max_new_tokens=8, temperature=1.0, seed=8)
    assert texts[0][1] == solo.text  # choice i uses seed + i


def test_concurrent_requests_equal_solo(served, client):
    _, _, reference = served
    prompts = [f"line {i}: The quick" for i in range(6)]
    out: dict[int, str] = {}

    def one(i):
        r = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=6, temperature=0)
        out[i] = r.choices[0].text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, p in enumerate(prompts):
        assert out[i] == reference.generate(p, max_new_tokens=6).text


AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"model": NAME, "prompt": "The", "max_tokens": 2}


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({**GOOD, "temperature": -1}, 400, "temperature"),
        ({**GOOD, "temperature": "hot"}, 400, "temperature"),
        ({**GOOD, "top_p": 2}, 400, "top_p"),
        ({**GOOD, "max_tokens": 0}, 400, "max_tokens"),
        ({**GOOD, "max_tokens": 1.5}, 400, "max_tokens"),
        ({**GOOD, "n": 0}, 400, "n"),
        ({**GOOD, "stop": 3}, 400, "stop"),
        ({**GOOD, "prompt": {"a": 1}}, 400, "prompt"),
        ({**GOOD, "prompt": [1, 99999]}, 400, "prompt"),
        ({"prompt": "The"}, 400, "model"),
        ({**GOOD, "model": "../../etc/passwd"}, 404, "model"),
        ({**GOOD, "max_tokens": 255, "prompt": "The quick brown fox"}, 400, "prompt"),
        ({**GOOD, "n": 7}, 503, None),  # max_batch 2 + queue 4 < 7
    ],
)
def test_bad_requests(served, body, status, param):
    r = httpx.post(served[0] + "/v1/completions", json=body, headers=AUTH)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["param"] == param
    if status == 503:
        assert "Retry-After" in r.headers


def test_context_error_names_both_numbers(served):
    body = {**GOOD, "max_tokens": 255, "prompt": "The quick brown fox"}
    msg = httpx.post(served[0] + "/v1/completions", json=body, headers=AUTH).json()["error"]
    assert "255" in msg["message"] and "256" in msg["message"]


@pytest.mark.parametrize(
    "raw, status",
    [
        (b"{not json", 400),
        (b'{"model": "tiny", "prompt": "a", "temperature": NaN}', 400),
        (b'{"model": "tiny", "prompt": "a", "temperature": Infinity}', 400),
        (b'{"model": "tiny", "prompt": "\\ud800"}', 400),
        (b"[1, 2]", 400),
        (b'{"model": "tiny", "prompt": "' + b"a" * (2 << 20) + b'"}', 413),
    ],
)
def test_malformed_bodies(served, raw, status):
    headers = {**AUTH, "Content-Type": "application/json"}
    r = httpx.post(served[0] + "/v1/completions", content=raw, headers=headers)
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_auth_routes_health_models(served):
    base = served[0]
    assert httpx.post(base + "/v1/completions", json=GOOD).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(base + "/v1/models", headers=wrong).status_code == 401
    assert httpx.get(base + "/health").status_code == 200  # no key needed
    models = httpx.get(base + "/v1/models", headers=AUTH).json()
    assert [m["id"] for m in models["data"]] == [NAME]
    r = httpx.get(base + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(base + "/v1/completions", json=GOOD, headers={**AUTH, "Origin": "http://x"})
    assert "access-control-allow-origin" not in r.headers


def test_property_no_500(served):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats() | st.text()
    values = st.recursive(scalars, lambda c: st.lists(c, max_size=3), max_leaves=5)
    keys = st.sampled_from(
        [
            "model",
            "prompt",
            "messages",
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "n",
            "seed",
            "stop",
            "stream",
            "stream_options",
        ]
    )
    bodies = st.dictionaries(keys, values, max_size=6).map(lambda d: {"model": NAME, **d})

    with httpx.Client(base_url=served[0], headers=AUTH, timeout=30) as http:

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=bodies, chat=st.booleans())
        def check(body, chat):
            if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 4:
                body["max_tokens"] = 4  # keep generations short
            body.setdefault("max_tokens", 2)
            route = "/v1/chat/completions" if chat else "/v1/completions"
            r = http.post(route, content=json.dumps(body, allow_nan=True))
            assert r.status_code < 500 or r.status_code == 503, r.text

        check()
        assert http.get("/health").status_code == 200


def test_disconnect_frees_slots(served, client):
    base, engine, _ = served
    body = {"model": NAME, "prompt": "The quick", "max_tokens": 200, "stream": True}
    for _ in range(4):
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            next(r.iter_lines())
    deadline = time.monotonic() + 30
    while engine.scheduler.busy() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.scheduler.busy()
    r = client.completions.create(model=NAME, prompt="The", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_sigterm_drains_and_exits_zero(tiny_checkpoints):
    folder = tiny_checkpoints["gemma"][0]
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "gemma_engine.server",
        "--model",
        str(folder),
        "--port",
        str(port),
        "--no-compile",
        "--served-model-name",
        NAME,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_health(base)
        result: dict = {}

        def slow():
            body = {**GOOD, "max_tokens": 60, "temperature": 0}
            result["r"] = httpx.post(base + "/v1/completions", json=body, timeout=60)

        t = threading.Thread(target=slow)
        t.start()
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        assert result["r"].status_code == 200  # the running request finished
    finally:
        if proc.poll() is None:
            proc.kill()


def test_gemma_chat_two_turns_reuse_cache(tiny_checkpoints):
    folder = tiny_checkpoints["gemma3"][0]
    cmd = [
        sys.executable,
        "-m",
        "gemma_engine.chat",
        "--model",
        str(folder),
        "--no-compile",
        "--stats",
        "--max-new-tokens",
        "6",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        cmd, input="The quick\nbrown fox\n", capture_output=True, text=True, timeout=120, env=env
    ).stdout
    stats = [line for line in out.splitlines() if line.startswith("[prompt")]
    assert len(stats) == 2, out
    first, second = ([int(w) for w in s.replace("]", "").split() if w.isdigit()] for s in stats)
    assert first[1] == 0 and second[1] > first[0] // 2  # turn 2 reuses turn 1's prompt
