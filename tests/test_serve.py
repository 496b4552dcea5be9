"""``llmcore serve``: the server as a subprocess on a loopback port, through the real
``openai`` client (and raw HTTP for what a client library would not send).

The program is the tiny nanoGPT (random weights, byte-level tokenizer, 128 positions),
given a chat template that starts with the first message's text: conversations that start
differently then share no cached tokens, so each greedy reference below is computed on
the same path as the server's (a full prefill from position 0). Authorities: ``llmcore run
--json`` and :func:`llmcore.runtime.generate.generate` on a freshly loaded program for the text,
the ``openai`` package for the protocol, the fresh program's logits for the cache reuse.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from servetools import reference, serve_program

openai = pytest.importorskip("openai")

TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }} [{{ m['role'] }}]\n{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)
MODEL = "tiny"


@pytest.fixture(scope="module")
def served(exports, tmp_path_factory):
    """(base URL, .pte path) of a server over the tiny program with a chat template."""
    with serve_program(exports("xnnpack").pte, tmp_path_factory.mktemp("serve"), TEMPLATE) as running:
        yield running


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def chat_prompt(*contents: str) -> str:
    roles = ["user", "assistant"]
    return "".join(f"{c} [{roles[i % 2]}]\n" for i, c in enumerate(contents)) + ">"


def post(base: str, path: str, data: bytes):
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_models_and_health(served, client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_greedy_equals_llmcore_run(served, client, cli):
    base, pte = served
    prompt = "Once upon a time"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    run = cli("run", str(pte), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0", "--json")
    assert run.returncode == 0, run.stderr
    expected = json.loads(run.stdout)
    assert got.choices[0].text == expected["text"]
    assert got.usage.prompt_tokens == len(expected["prompt_ids"])
    assert got.usage.completion_tokens == len([t for t in expected["generated_ids"] if t != 256])


def test_chat_non_streaming_and_streaming_agree(served, client):
    _, pte = served
    messages = [{"role": "user", "content": "Tell me about llamas"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    text = plain.choices[0].message.content
    assert text == reference(pte, chat_prompt("Tell me about llamas"), 10)
    assert plain.choices[0].finish_reason in ("length", "stop") and plain.usage.completion_tokens <= 10
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "xyz"}], max_tokens=2)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_stop_strings_and_max_tokens(served, client):
    messages = [{"role": "user", "content": "Write a list"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    assert len(text) >= 6
    stop = text[3:5]
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "zz"}], max_tokens=2)
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "zz"}], max_tokens=2)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[: text.find(stop)]
    three = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
    assert three.usage.completion_tokens <= 3
    if three.usage.completion_tokens == 3:
        assert three.choices[0].finish_reason == "length"


def test_sampling_with_a_seed_repeats(served, client):
    messages = [{"role": "user", "content": "Sample"}]
    a, b = (client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0,
                                           top_p=0.9, seed=7).choices[0].message.content for _ in range(2))
    assert a == b


def test_next_turn_reuses_the_cache(served, client):
    base, _ = served
    first = [{"role": "user", "content": "Hello, who are you?"}]
    one = client.chat.completions.create(model=MODEL, messages=first, max_tokens=6, temperature=0)
    before = json.loads(urllib.request.urlopen(base + "/metrics").read())
    second = first + [{"role": "assistant", "content": one.choices[0].message.content},
                      {"role": "user", "content": "And then?"}]
    two = client.chat.completions.create(model=MODEL, messages=second, max_tokens=6, temperature=0)
    after = json.loads(urllib.request.urlopen(base + "/metrics").read())
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= one.usage.prompt_tokens  # at least the whole first prompt
    assert after["prompt_tokens_prefilled"] - before["prompt_tokens_prefilled"] == two.usage.prompt_tokens - cached
    assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == cached


BAD = [
    (b"{not json", 400, None),
    (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}).encode(), 400,
     "max_tokens"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}).encode(),
     400, "max_tokens"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).encode(),
     400, "temperature"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 500}]}).encode(), 400, "messages"),
    (json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404, "model"),
]


@pytest.mark.parametrize("data, status, param", BAD)
def test_bad_input_gets_an_openai_error_and_the_server_stays_up(served, client, data, status, param):
    base, _ = served
    code, body, _ = post(base, "/v1/chat/completions", data)
    assert code == status and body["error"]["param"] == param and body["error"]["message"]
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok?"}], max_tokens=2)
    assert ok.choices[0].message.role == "assistant"


def test_an_unknown_role_is_a_400_and_developer_speaks_as_system(served, client):
    """OpenAI answers an unknown role with a 400 naming ``messages[i].role``; ``developer``
    (its newer name for ``system``) reaches the template as ``system``."""
    _, pte = served
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"},
                                                              {"role": "wizard", "content": "hi"}], max_tokens=2)
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == "messages[1].role"
    assert "'wizard'" in error["message"] and error["code"] == "invalid_value"
    messages = [{"role": "developer", "content": "Answer briefly"}, {"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == reference(pte, "Answer briefly [system]\nhi [user]\n>", 6)


DEEP = 100_000  # levels of nesting in a 200 KB body: Python's json recursed until RecursionError, a plain 500


@pytest.mark.parametrize("data", [
    b"[" * DEEP + b"]" * DEEP,
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "metadata": "@"}).encode()
    .replace(b'"@"', b"[" * DEEP + b"]" * DEEP),
], ids=["array", "inside-a-request"])
def test_a_body_nested_past_the_limit_is_a_400_and_the_server_stays_up(served, client, data):
    code, body, headers = post(served[0], "/v1/chat/completions", data)
    assert code == 400 and headers["content-type"] == "application/json"
    assert body["error"]["type"] == "invalid_request_error" and "more than 512 deep" in body["error"]["message"]
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok?"}], max_tokens=2)
    assert ok.choices[0].message.role == "assistant"


def test_tool_call_arguments_nested_past_the_limit_are_a_400(served):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "[" * DEEP}}
    data = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": None, "tool_calls": [call]}]})
    code, body, _ = post(served[0], "/v1/chat/completions", data.encode())
    assert code == 400 and body["error"]["param"] == "messages[1].tool_calls"


def test_context_overflow_has_its_code(served):
    code, body, _ = post(served[0], "/v1/completions", json.dumps({"model": MODEL, "prompt": "y" * 400}).encode())
    assert code == 400 and body["error"]["code"] == "context_length_exceeded"


def test_client_gone_mid_stream_leaves_the_server_working(served, client):
    base, _ = served
    request = urllib.request.Request(
        base + "/v1/chat/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a long story"}],
                         "max_tokens": 100, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.readline().startswith(b"data: ")  # then hang up
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "still there?"}],
                                        max_tokens=2)
    assert ok.choices[0].message.role == "assistant"


# ---- the scheduling and the generation loop, in process ----------------------------------------


@pytest.fixture(scope="module")
def engine(served):
    from llmcore.runtime.session import Engine

    _, pte = served
    return Engine(str(pte), str(pte.with_name("tokenizer.json")))


def test_generation_stops_when_cancelled(engine, monkeypatch):
    """A client that goes away sets the event; the loop stops at the next token."""
    from llmcore.runtime.session import Request, run

    cancelled = threading.Event()
    step = engine.step
    steps = []

    def counting_step(token):
        steps.append(token)
        if len(steps) == 3:
            cancelled.set()
        return step(token)

    monkeypatch.setattr(engine, "step", counting_step)
    req = Request(list(b"cancel me"), 50, 0.0, 1.0, None, [])
    out = run(engine, req, lambda text: None, cancelled)
    assert len(steps) == 3 and out.completion_tokens == 3


def test_reused_cache_gives_the_fresh_programs_logits(engine, served):
    from llmcore.runtime import Program

    fresh = Program.load(served[1])
    first = list(b"The cat sat on the mat.")
    engine.prefill(first)
    for t in b" Then":
        engine.step([t])
    second = first + list(b" Then it slept")
    logits, kept = engine.prefill(second)
    assert kept == len(first) + len(b" Then")
    assert torch.allclose(torch.as_tensor(logits), fresh.logits(second, 0), atol=1e-4, rtol=1e-4)
    other = list(b"Different start")
    _, kept = engine.prefill(other)
    assert kept == 0


def test_engine_lends_the_programs_row_until_its_next_call(engine, served):
    """The engine samples from the program's own logits (no copy a step): the row it returns
    holds a fresh program's logits, and its next call writes over that same memory."""
    from llmcore.runtime import Program

    ids = list(b"Lent rows")
    row, _ = engine.prefill(ids)
    kept = row.copy()
    assert np.allclose(kept, Program.load(served[1]).logits(ids, 0).numpy(), atol=1e-4, rtol=1e-4)
    after = engine.step([int(kept.argmax())])
    assert np.shares_memory(row, after) and not np.array_equal(row, kept)


def test_ring_buffer_programs_reuse_only_an_exact_extension(exports):
    from llmcore.runtime import Program
    from llmcore.runtime.session import Engine

    result = exports("ring")
    ring = Engine(str(result.pte), str(result.pte.with_name("tokenizer.json")))
    assert ring.ring
    vocab = ring.program.metadata.get("get_vocab_size", 64)
    ids = [int(t) for t in torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(0))]
    ring.prefill(ids[:30])
    assert ring.reusable(ids[:20]) == 0  # a shorter prefix: rows past it may be overwritten
    logits, kept = ring.prefill(ids)
    assert kept == 30
    assert torch.allclose(torch.as_tensor(logits), Program.load(result.pte).logits(ids, 0), atol=1e-4, rtol=1e-4)


def test_queue_is_fair_and_bounded(engine):
    from llmcore.apps.serve import RequestError, Server

    async def scenario():
        server = Server([engine], MODEL, max_queue=2)
        held = await server.acquire([1])
        order = []

        async def wait(name):
            e = await server.acquire([1])
            order.append(name)
            server.release(e)

        waiters = [asyncio.ensure_future(wait(n)) for n in ("a", "b")]
        await asyncio.sleep(0)
        with pytest.raises(RequestError) as busy:
            await server.acquire([1])
        server.release(held)
        await asyncio.gather(*waiters)
        return order, busy.value

    order, busy = asyncio.run(scenario())
    assert order == ["a", "b"]
    assert busy.status == 503 and busy.headers == {"Retry-After": "1"}


def test_chat_in_the_terminal_keeps_history_and_reuses_the_cache(served):
    """``llmcore chat``: two turns, /reset, a third; the second turn's prompt starts with the
    first's (the chat template writes the conversation so far), so it comes from the cache."""
    _, pte = served
    import subprocess as sp

    out = sp.run([sys.executable, "-m", "llmcore", "chat", str(pte), "--max-new-tokens", "6"],
                 input="hello\nagain\n/reset\nthird\n/exit\n", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    stats = [line for line in out.stderr.splitlines() if line.startswith("[prompt ")]
    assert len(stats) == 3 and "(a new conversation)" in out.stderr
    cached = [int(line.split(", ")[1].split()[0]) for line in stats]
    prompts = [int(line.split()[1]) for line in stats]
    assert prompts[1] > prompts[0] and cached[1] >= len("hello [user]\n")  # the first turn is kept
    assert prompts[2] == prompts[0]  # /reset: the history is gone
    first_reply = reference(pte, chat_prompt("hello"), 6)
    assert out.stdout.startswith("> " + first_reply)


def test_parallel_instances_go_to_the_one_whose_cache_fits(engine, served):
    """With --parallel, a free instance whose cache already holds the start of the prompt is
    preferred: the next turn of a conversation lands where its history is."""
    from llmcore.apps.serve import Server
    from llmcore.runtime.session import Engine

    other = Engine(str(served[1]), str(served[1].with_name("tokenizer.json")))
    conversation = list(b"a conversation so far")
    other.prefill(conversation)
    engine.prefill(list(b"something else"))

    async def scenario():
        server = Server([engine, other], MODEL)
        first = await server.acquire(conversation + list(b" and more"))
        second = await server.acquire(list(b"something else entirely"))
        return first, second

    first, second = asyncio.run(scenario())
    assert first is other and second is engine
