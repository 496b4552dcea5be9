"""Tool calls and structured output, enforced by a grammar (llguidance), through the real
``openai`` client against ``llmcore serve`` as a subprocess.

The program is the tiny nanoGPT with random weights: whatever it writes on its own is noise,
so every answer that parses and validates against its schema (checked with ``jsonschema``)
shows the token mask at work, not the model. Its context is 128 byte-level tokens, so the
schemas keep their strings and numbers short. The chat template is Hermes-style: it lists
the tools inside ``<tool_call>`` tags, so calls come back in that format.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TEMPLATE = (
    "{% if tools %}<tool_call>{% for t in tools %}{{ t.function.name }} {% endfor %}</tool_call>\n{% endif %}"
    "{% for m in messages %}{{ m['content'] }} [{{ m['role'] }}]\n{% endfor %}"
    "{% if add_generation_prompt %}>{% endif %}"
)
MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "wx", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "t", "parameters": {
    "type": "object", "properties": {"h": {"type": "integer", "minimum": 0, "maximum": 23}}, "required": ["h"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def served(exports, tmp_path_factory):
    from servetools import serve_program

    with serve_program(exports("xnnpack").pte, tmp_path_factory.mktemp("structured"), TEMPLATE) as running:
        yield running


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


def ask(client, content="rain?", **fields):
    fields.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **fields)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_answers_validate(client, seed):
    reply = ask(client, "Answer:", temperature=1.0, seed=seed, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"


def test_json_object_answers_parse_when_they_end(client):
    """Any object: keys are strings of any length, which a random model may not close within
    80 tokens. A reply that ended (finish_reason "stop") parses; one cut at max_tokens is the
    start of an object."""
    ended = 0
    for seed in range(4):
        choice = ask(client, "Answer:", temperature=0.8, seed=seed, response_format={"type": "json_object"}).choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
            ended += 1
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    print(f"{ended} of 4 json_object replies ended within 80 tokens")


def arguments_valid(call, tools):
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("seed", [0, 1])
def test_required_tool_call_arguments_validate(client, seed):
    reply = ask(client, tools=[WEATHER, TIME], tool_choice="required", temperature=1.0, seed=seed)
    choice = choice_of(reply)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    arguments_valid(call, [WEATHER, TIME])


def choice_of(reply):
    return reply.choices[0]


def test_named_tool_choice_calls_that_tool(client):
    reply = ask(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "t"}},
                temperature=1.0, seed=5)
    [call] = choice_of(reply).message.tool_calls
    assert call.function.name == "t"
    arguments_valid(call, [TIME])


def test_streamed_tool_call_deltas_add_up_to_the_call(client):
    fields = dict(tools=[WEATHER], tool_choice="required", temperature=1.0, seed=7)
    whole = choice_of(ask(client, **fields)).message.tool_calls[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "rain?"}],
                                                 max_tokens=80, stream=True, **fields))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and all(d.index == 0 for d in deltas)
    assert "".join(d.function.name or "" for d in deltas) == whole.function.name
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_never_calls(client):
    for seed in range(3):
        reply = ask(client, tools=[WEATHER], tool_choice="none", temperature=1.0, seed=seed, max_tokens=20)
        assert not choice_of(reply).message.tool_calls and choice_of(reply).finish_reason != "tool_calls"


def test_auto_gives_a_valid_call_or_plain_text(client):
    for seed in range(4):
        choice = choice_of(ask(client, tools=[WEATHER], temperature=1.0, seed=seed))
        if choice.message.tool_calls:
            arguments_valid(choice.message.tool_calls[0], [WEATHER])
        else:
            assert not choice.message.content.lstrip().startswith("<")


def test_a_tool_result_continues_the_conversation(client):
    reply = ask(client, tools=[WEATHER], tool_choice="required", seed=1, temperature=1.0)
    call = choice_of(reply).message.tool_calls[0]
    messages = [{"role": "user", "content": "rain?"},
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": "dry"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=4)
    assert choice_of(reply).message.role == "assistant"


def post(base, data):
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(data).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


HI = [{"role": "user", "content": "hi"}]
BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [{"type": "function", "name": "flat"}]}, "tools"),
    ({"tools": "wx"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": HI + [{"role": "tool", "tool_call_id": "call_unknown", "content": "x"}]}, "messages[1].tool_call_id"),
]


@pytest.mark.parametrize("fields, param", BAD)
def test_bad_tool_and_schema_requests_are_400_naming_the_field(served, client, fields, param):
    code, body = post(served[0], {"model": MODEL, "messages": HI, **fields})
    assert code == 400 and body["error"]["param"] == param, body
    assert choice_of(ask(client, max_tokens=2)).message.role == "assistant"  # still serving


def test_run_json_schema_cli(served, cli, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    result = cli("run", str(served[1]), "--prompt", "Answer:", "--json-schema", str(schema), "--max-new-tokens", "60",
                 "--temperature", "1", "--seed", "4", "--json")
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(json.loads(result.stdout)["text"]), SCHEMA)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "nonsense"}))
    refused = cli("run", str(served[1]), "--prompt", "x", "--json-schema", str(bad))
    assert refused.returncode == 2 and "--json-schema" in refused.stderr and "Fix:" in refused.stderr


def test_tools_are_described_to_a_template_that_does_not_render_them():
    from llmcore.apps.serve import tools_in_system_message

    plain = tools_in_system_message([{"role": "user", "content": "hi"}], [WEATHER])
    assert plain[0]["role"] == "system" and '"name": "wx"' in plain[0]["content"] and plain[1]["content"] == "hi"
    merged = tools_in_system_message([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                     [WEATHER])
    assert len(merged) == 2 and merged[0]["content"].startswith("Be brief.") and '"wx"' in merged[0]["content"]


def test_tool_arguments_take_only_the_listed_properties_unless_the_schema_says_otherwise(served):
    import torch

    from llmcore.runtime.constrain import Constraint, Tool, tool_call_grammar

    tokenizer = served[1].with_name("tokenizer.json").read_text()  # byte-level: token id = byte value
    for extra, comma_allowed in ((None, False), (True, True)):
        parameters = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 5}}}
        if extra is not None:
            parameters["additionalProperties"] = extra
        c = Constraint(tool_call_grammar([Tool("f", parameters)], tagged=False, optional=False), tokenizer, [256], 257)
        for byte in b'{"name": "f", "arguments": {"a": 1':
            c.consume(byte)
        allowed = c.filter(torch.zeros(257)) > float("-inf")
        assert bool(allowed[ord("}")]) and bool(allowed[ord(",")]) is comma_allowed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampling_the_models_pick_first_gives_the_masked_distribution(served, temperature):
    """``Constraint.sample`` asks the grammar about the model's own pick before computing a
    mask. Greedy: every step equals the argmax of the masked logits. Temperature 1: the
    frequencies of a step with a few allowed tokens match the masked softmax."""
    import torch

    from llmcore.runtime.constrain import Constraint, json_schema_grammar
    from llmcore.runtime.generate import Sampling

    tokenizer = served[1].with_name("tokenizer.json").read_text()  # byte-level: token id = byte value
    grammar = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    gen = torch.Generator().manual_seed(0)
    if temperature == 0:
        fast, slow = (Constraint(grammar, tokenizer, [256], 257) for _ in range(2))
        for step in range(12):
            logits = torch.randn(257, generator=gen) * 4
            expected = int(torch.argmax(slow.filter(logits)))
            if step % 2:  # the model favours an allowed token: no mask needed
                logits[expected] += 100.0
            token = fast.sample(logits, Sampling())  # consumed by fast's grammar
            assert token == expected
            slow.consume(token)
        assert fast.masks == 6 and fast.tokens == 12
        return
    # after '{"n": ' the grammar allows a digit or '-': favour a forbidden token heavily
    logits = torch.full((257,), -2.0)
    logits[ord("x")] = 3.0
    logits[ord("1")], logits[ord("2")] = 1.0, 0.0
    allowed = [ord(c) for c in "-0123456789"]
    expected = torch.softmax(logits[allowed], 0)
    counts = dict.fromkeys(allowed, 0)
    sampling = Sampling(temperature=1.0, seed=1)
    n = 4000
    for _ in range(n):
        c = Constraint(grammar, tokenizer, [256], 257)
        for byte in b'{"n": ':
            c.consume(byte)
        counts[c.sample(logits, sampling)] += 1
    got = torch.tensor([counts[t] / n for t in allowed])
    assert float((got - expected).abs().max()) < 0.03, (got, expected)


def test_forced_tokens_go_to_the_program_together_and_change_nothing(served):
    """What the grammar forces (the opening of a tool call, the next key of a schema) is fed
    in one call with the sampled token: greedy generation writes the same tokens as one
    forward pass per token, in fewer calls."""
    from llmcore.runtime.constrain import Constraint, Tool, tool_call_grammar
    from llmcore.runtime.generate import Sampling, generate
    from llmcore.runtime import Program

    pte = served[1]
    tokenizer = pte.with_name("tokenizer.json").read_text()  # byte-level: token id = byte value
    grammar = tool_call_grammar([Tool("wx", WEATHER["function"]["parameters"])], tagged=True, optional=False)
    opening = Constraint(grammar, tokenizer, [256], 257).forced()
    assert bytes(opening).decode() == '<tool_call>\n{"name": "wx", "arguments": {"city": "'

    program = Program.load(pte)
    calls = []
    read_logits = program.read_logits
    program.read_logits = lambda tokens, pos, read: calls.append(len(tokens)) or read_logits(tokens, pos, read)
    runs = {}
    for fast_forward in (False, True):
        calls.clear()
        constraint = Constraint(grammar, tokenizer, [256], 257, fast_forward=fast_forward)
        out = generate(program, list(b"rain? [user]\n>"), 80, Sampling(), constraint=constraint)
        runs[fast_forward] = (out.generated_ids, len(calls), constraint.forced_tokens)
    (slow_ids, slow_calls, none_forced), (fast_ids, fast_calls, forced) = runs[False], runs[True]
    assert fast_ids == slow_ids and none_forced == 0
    assert bytes(fast_ids).decode().endswith('"}}\n</tool_call>')
    assert forced >= len(opening) + len('"}}\n</tool_call>') - 1
    assert fast_calls == slow_calls - forced
