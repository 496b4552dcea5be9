"""``llmcore serve``: an OpenAI-compatible HTTP server over a ``.pte`` program.

Tools that talk to a local model (editors, agents, the ``openai`` package) expect the
OpenAI API: ``POST /v1/chat/completions`` and ``/v1/completions``, streamed as server-sent
events or not, ``GET /v1/models``. This module gives them that over an exported program,
on Starlette (the ASGI toolkit) served by uvicorn: the HTTP, the event stream framing and
client disconnects are theirs; what is here is the OpenAI request and response shapes and
the scheduling of one program.

Scheduling. A program holds one KV cache, so it serves one request at a time; requests
wait their turn in arrival order (``--max-queue`` of them at most: more get 503 with
``Retry-After``). ``--parallel N`` loads N instances, each with its own cache. The
generation runs in a worker thread, token by token, and stops at the next token when the
client goes away; the program is free again as soon as it stops.

KV-cache reuse. Each instance is an :class:`~llmcore.runtime.session.Engine`, which
remembers which tokens its cache holds: the next turn of a conversation is prefilled from
its first new token only. ``usage`` reports the reused tokens as
``prompt_tokens_details.cached_tokens``, and ``GET /metrics`` counts prompt tokens prefilled
and reused.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from llmcore import nesting
from llmcore.errors import LlmcoreError
from llmcore.runtime.chat_template import add_template_option, load_template
from llmcore.runtime.session import Engine, Outcome, Request, run

DEFAULT_MAX_QUEUE = 16
MAX_STOP_STRINGS = 4  # OpenAI's limit
# The roles OpenAI's chat API takes. "developer" is its newer name for "system" (o1 and later
# models); chat templates know only "system", so it reaches them as that.
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending parameter, a code."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "invalid_request_error", 503: "server_overloaded"}
        return {"error": {"message": self.message, "type": kind.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


# ---- requests ---------------------------------------------------------------------------------


@dataclass
class CompletionRequest(Request):
    """A validated completion request: what to generate (:class:`~llmcore.runtime.session.Request`)
    and how to answer it."""

    stream: bool = False
    include_usage: bool = False
    tool_format: Optional[str] = None  # "tagged" / "bare" when the reply may be a tool call


_MISSING = object()


def _get(body: dict, name: str, kinds: tuple, default: Any = None, *, check: Optional[Callable] = None,
         why: str = "") -> Any:
    """``body[name]`` if it has one of ``kinds`` (and passes ``check``), else a 400 naming it."""
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:  # JSON true is not a number here
        raise RequestError(400, f"'{name}' must be {why or kinds[0].__name__}, not a boolean.", name)
    if not isinstance(value, kinds) or (check is not None and not check(value)):
        raise RequestError(400, f"'{name}' must be {why or kinds[0].__name__}; got {json.dumps(value)[:80]}.", name)
    return value


def _text_content(message: dict, index: int) -> str:
    """A message's content: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(400, f"messages[{index}].content must be a string or a list of text parts.",
                       f"messages[{index}].content")


def chat_messages(body: dict) -> list[dict]:
    """The conversation as the chat template takes it: role and text content, and the tool
    fields (an assistant's ``tool_calls`` with their arguments as objects, a tool message's
    ``tool_call_id``), each tool message answering a call made before it."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list of {role, content} objects.", "messages")
    out, call_ids = [], set()
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, f"messages[{i}] must be an object with a string 'role'.", f"messages[{i}]")
        if m["role"] not in ROLES:
            raise RequestError(400, f"messages[{i}].role is {m['role'][:40]!r}; it must be one of "
                               f"{', '.join(ROLES)}.", f"messages[{i}].role", "invalid_value")
        role = "system" if m["role"] == "developer" else m["role"]
        message = {"role": role, "content": _text_content(m, i)}
        calls = m.get("tool_calls")
        if role == "assistant" and calls:
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise RequestError(400, f"messages[{i}].tool_calls must be a list of function calls.",
                                   f"messages[{i}].tool_calls")
            message["tool_calls"] = [_call_for_template(c, f"messages[{i}].tool_calls") for c in calls]
            call_ids.update(c.get("id") for c in calls if isinstance(c.get("id"), str))
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in call_ids:
                raise RequestError(400, f"messages[{i}] is a tool result for call {call_id!r}, which no earlier "
                                   "assistant message made.", f"messages[{i}].tool_call_id")
            message["tool_call_id"] = call_id
        out.append(message)
    return out


def _call_for_template(call: dict, where: str) -> dict:
    """An OpenAI tool call as chat templates read it: ``arguments`` as an object when it is JSON."""
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = nesting.loads(function["arguments"], stage="serve",
                                                  what=f"the 'arguments' string of a call in {where}")
        except ValueError:
            pass
        except LlmcoreError as exc:
            raise RequestError(400, exc.message, where) from None
    return {"id": call.get("id"), "type": "function", "function": function}


def tools_in_system_message(messages: list[dict], tools: list) -> list[dict]:
    """For a chat template that does not render ``tools`` (SmolLM2's, say): the tools, and
    the call format the grammar enforces, described in the system message, as llama.cpp's
    server does, so the model knows what it may call."""
    described = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    text = ("You can call these functions; to call one, reply with only a JSON object "
            '{"name": <function name>, "arguments": {<its arguments>}}.\n' + described)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def request_tools(body: dict) -> tuple[list, str]:
    """``tools`` as :class:`llmcore.runtime.constrain.Tool` records and the ``tool_choice``:
    "none", "auto", "required" or a tool's name."""
    from llmcore.runtime.constrain import Tool

    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise RequestError(400, "'tool_choice' needs 'tools'.", "tool_choice")
        return [], "none"
    if not isinstance(tools, list) or not tools or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            and isinstance(t["function"].get("parameters", {}), dict) for t in tools):
        raise RequestError(400, "'tools' must be a non-empty list of {\"type\": \"function\", \"function\": "
                           "{\"name\": ..., \"parameters\": {...}}}.", "tools")
    records = [Tool(t["function"]["name"], t["function"].get("parameters") or {"type": "object"}) for t in tools]
    if choice is None:
        return records, "auto"
    if choice in ("none", "auto", "required"):
        return records, choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise RequestError(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}.", "tool_choice")
    if name not in {t.name for t in records}:
        raise RequestError(400, f"'tool_choice' names {name!r}, which is not among the tools.", "tool_choice")
    return records, name


def reply_grammar(body: dict, tools: list, choice: str, tagged: bool) -> tuple[Optional[str], Optional[str]]:
    """The grammar the reply must follow (tools or ``response_format``), and the tool-call
    format when the reply may be a call."""
    from llmcore.runtime.constrain import GrammarError, json_object_grammar, json_schema_grammar, tool_call_grammar

    try:
        if tools and choice != "none":
            chosen = tools if choice in ("auto", "required") else [t for t in tools if t.name == choice]
            grammar = tool_call_grammar(chosen, tagged, optional=choice == "auto")
            return grammar, "tagged" if tagged else "bare"
    except GrammarError as exc:
        raise RequestError(400, f"a tool's parameters cannot be compiled to a grammar: {exc}", "tools") from None
    fmt = body.get("response_format")
    if fmt is None:
        return None, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    try:
        if kind == "text":
            return None, None
        if kind == "json_object":
            return json_object_grammar(), None
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise RequestError(400, "'response_format.json_schema' must be an object with a 'schema' object.",
                                   "response_format")
            return json_schema_grammar(spec.get("schema") or {}), None
    except GrammarError as exc:
        raise RequestError(400, f"the JSON schema cannot be compiled to a grammar: {exc}", "response_format") from None
    raise RequestError(400, "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\".",
                       "response_format")


def parse_request(body: Any, prompt_ids: Callable[[dict], list[int]], context: int,
                  tool_tagged: Optional[bool] = None) -> CompletionRequest:
    """Validate the sampling fields OpenAI defines (a wrong type or range is a 400 naming the
    field; fields not read here are ignored, as OpenAI's clients send several) and tokenize
    the prompt with ``prompt_ids(body)``."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object.")
    if _get(body, "n", (int,), 1) != 1:
        raise RequestError(400, "only n=1 is supported: one program generates one completion at a time.", "n")
    temperature = float(_get(body, "temperature", (int, float), 1.0, check=lambda v: 0 <= v <= 2,
                             why="a number from 0 to 2"))
    top_p = float(_get(body, "top_p", (int, float), 1.0, check=lambda v: 0 < v <= 1, why="a number in (0, 1]"))
    seed = _get(body, "seed", (int,))
    stop = _get(body, "stop", (str, list), [], check=lambda v: isinstance(v, str) or (
        len(v) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in v)),
        why=f"a string or a list of at most {MAX_STOP_STRINGS} non-empty strings")
    stop = [stop] if isinstance(stop, str) else list(stop)
    stream = _get(body, "stream", (bool,), False, why="a boolean")
    options = _get(body, "stream_options", (dict,), {}, why="an object")
    include_usage = bool(options.get("include_usage", False))
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, name, (int,), None, check=lambda v: 1 <= v <= context,
                      why=f"an integer from 1 to the program's context ({context})")
    grammar = tool_format = None
    if tool_tagged is not None:  # a chat request: tools and response_format apply
        tools, choice = request_tools(body)
        grammar, tool_format = reply_grammar(body, tools, choice, tool_tagged)
    ids = prompt_ids(body)
    if len(ids) >= context:
        raise RequestError(400, f"the prompt has {len(ids)} tokens; this program's context holds {context}, "
                           "with room for at least one generated token.", "messages", "context_length_exceeded")
    room = context - len(ids)
    return CompletionRequest(ids, min(max_tokens or room, room), temperature, top_p, seed, stop, grammar,
                             stream, include_usage, tool_format)


# ---- the server ---------------------------------------------------------------------------------


@dataclass
class Metrics:
    requests: int = 0
    rejected_busy: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    prompt_tokens_prefilled: int = 0
    prompt_tokens_cached: int = 0
    completion_tokens: int = 0


@dataclass
class Server:
    """The engines, the model's chat template (None: /v1/completions only) and the queue."""

    engines: list[Engine]
    model_id: str
    template: Any = None
    max_queue: int = DEFAULT_MAX_QUEUE
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.tokenizer = self.engines[0].tokenizer
        self.program = self.engines[0].program
        self._free: Optional[asyncio.Queue] = None
        self._waiting = 0

    # -- prompts
    def _ids(self, text: str) -> list[int]:
        from llmcore.runtime.generate import prompt_ids_for

        return prompt_ids_for(self.program, self.tokenizer, text)

    def chat_ids(self, body: dict) -> list[int]:
        messages = chat_messages(body)
        if self.template is None:
            raise RequestError(400, "this model has no chat template: send a raw prompt to /v1/completions, or "
                               "start the server with --chat-template.", "messages")
        tools = body.get("tools") if isinstance(body.get("tools"), list) else None
        if tools and "tools" not in self.template.source:
            messages = tools_in_system_message(messages, tools)
        try:
            return self._ids(self.template.render(messages, tools=tools))
        except LlmcoreError as exc:
            raise RequestError(400, exc.message, "messages") from None

    def completion_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(400, "'prompt' must be a non-empty string.", "prompt")
        return self._ids(prompt)

    def check_model(self, body: Any) -> None:
        if isinstance(body, dict) and body.get("model") not in (None, self.model_id):
            raise RequestError(404, f"the model {body.get('model')!r} does not exist; this server has "
                               f"{self.model_id!r}.", "model", "model_not_found")

    # -- scheduling
    async def acquire(self, ids: list[int]) -> Engine:
        """A free engine, in arrival order; of several free ones, the one whose cache holds
        the most of ``ids``. 503 when ``max_queue`` requests wait already."""
        if self._free is None:
            self._free = asyncio.Queue()
            for e in self.engines:
                self._free.put_nowait(e)
        if self._free.empty() and self._waiting >= self.max_queue:
            self.metrics.rejected_busy += 1
            raise RequestError(503, f"the server is busy ({self._waiting} requests waiting); retry shortly.",
                               code="server_busy", headers={"Retry-After": "1"})
        self._waiting += 1
        try:
            first = await self._free.get()
        finally:
            self._waiting -= 1
        others = []
        while not self._free.empty():
            others.append(self._free.get_nowait())
        best = max([first] + others, key=lambda e: e.reusable(ids))
        for e in [first] + others:
            if e is not best:
                self._free.put_nowait(e)
        return best

    def release(self, engine: Engine) -> None:
        self._free.put_nowait(engine)

    def account(self, outcome: Outcome, cancelled: bool) -> None:
        m = self.metrics
        m.requests += 1
        m.cancelled += int(cancelled)
        m.prompt_tokens += outcome.prompt_tokens
        m.prompt_tokens_cached += outcome.cached_tokens
        m.prompt_tokens_prefilled += outcome.prompt_tokens - outcome.cached_tokens
        m.completion_tokens += outcome.completion_tokens


def _usage(o: Outcome) -> dict:
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": o.cached_tokens}}


def create_app(server: Server):
    """The Starlette application of ``server``."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as HttpRequest
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error_response(err: RequestError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    async def read_body(request: HttpRequest) -> Any:
        try:
            return nesting.loads(await request.body(), what="the request body", stage="serve")
        except (ValueError, UnicodeDecodeError):
            raise RequestError(400, "the request body is not valid JSON.") from None
        except LlmcoreError as exc:  # nested past the limit
            raise RequestError(400, exc.message) from None

    async def complete(request: HttpRequest, chat: bool):
        try:
            body = await read_body(request)
            server.check_model(body)
            ids_of = server.chat_ids if chat else server.completion_ids
            # chat requests take tools and response_format; the template decides the call format
            tagged = bool(server.template and server.template.tool_calls_tagged) if chat else None
            req = parse_request(body, ids_of, server.program.max_context_len, tagged)
            if chat and server.template is not None:  # a built-in format's turn end (llmcore.runtime.chat_template.END_OF_TURN)
                req.stop = req.stop + [s for s in server.template.stop_strings if s not in req.stop]
            engine = await server.acquire(req.prompt_ids)
        except RequestError as err:
            return error_response(err)
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]

        def work() -> Outcome:
            try:
                outcome = run(engine, req, lambda s: loop.call_soon_threadsafe(deltas.put_nowait, s), cancelled)
                server.account(outcome, cancelled.is_set())
                return outcome
            finally:
                loop.call_soon_threadsafe(server.release, engine)
                loop.call_soon_threadsafe(deltas.put_nowait, None)

        task = loop.run_in_executor(None, work)

        def chunk(delta: Optional[dict | str], finish: Optional[str], first: bool = False) -> dict:
            if chat:
                if first:
                    d = {"role": "assistant", "content": ""}
                else:
                    d = {} if delta is None else (delta if isinstance(delta, dict) else {"content": delta})
                choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
                kind = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
                kind = "text_completion"
            return {"id": ident, "object": kind, "created": int(time.time()), "model": server.model_id,
                    "choices": [choice]}

        def tool_calls(outcome: Outcome) -> Optional[list]:
            """The reply as OpenAI tool calls, when it is one in the template's format."""
            from llmcore.runtime.constrain import parse_tool_call

            if req.tool_format is None:
                return None
            call = parse_tool_call(outcome.text, tagged=req.tool_format == "tagged")
            if call is None:
                return None
            return [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                     "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]

        # a reply that may be a tool call is held back until it is known not to start like one
        call_start = {"tagged": "<", "bare": "{"}.get(req.tool_format or "")

        if req.stream:
            async def events():
                try:
                    if chat:
                        yield f"data: {json.dumps(chunk(None, None, first=True))}\n\n"
                    held, holding = "", call_start is not None
                    while (delta := await deltas.get()) is not None:
                        if holding:
                            held += delta
                            if not held.lstrip():
                                continue
                            holding = held.lstrip().startswith(call_start)
                            if holding:
                                continue
                            delta, held = held, ""
                        yield f"data: {json.dumps(chunk(delta, None))}\n\n"
                    outcome = await task
                    calls = tool_calls(outcome)
                    finish = outcome.finish_reason
                    if calls:
                        delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
                        yield f"data: {json.dumps(chunk(delta, None))}\n\n"
                        finish = "tool_calls"
                    elif held:
                        yield f"data: {json.dumps(chunk(held, None))}\n\n"
                    yield f"data: {json.dumps(chunk(None, finish))}\n\n"
                    if req.include_usage:
                        usage = {**chunk(None, None), "choices": [], "usage": _usage(outcome)}
                        yield f"data: {json.dumps(usage)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:  # the client left (or the stream ended): stop generating
                    cancelled.set()

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        async def watch_disconnect():
            while not task.done():
                if await request.is_disconnected():
                    cancelled.set()
                    return
                await asyncio.sleep(0.05)

        watcher = asyncio.ensure_future(watch_disconnect())
        try:
            outcome = await task
        finally:
            watcher.cancel()
        if chat:
            calls = tool_calls(outcome)
            message = {"role": "assistant", "content": None if calls else outcome.text}
            if calls:
                message["tool_calls"] = calls
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else outcome.finish_reason,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": outcome.text, "finish_reason": outcome.finish_reason, "logprobs": None}
        return JSONResponse({"id": ident, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": server.model_id, "choices": [choice],
                             "usage": _usage(outcome)})

    async def chat_completions(request: HttpRequest):
        return await complete(request, chat=True)

    async def completions(request: HttpRequest):
        return await complete(request, chat=False)

    async def models(request: HttpRequest):
        return JSONResponse({"object": "list", "data": [
            {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "llmcore"}]})

    async def health(request: HttpRequest):
        return JSONResponse({"status": "ok"})

    async def metrics(request: HttpRequest):
        return JSONResponse({**vars(server.metrics), "instances": len(server.engines),
                             "waiting": server._waiting})

    async def http_error(request: HttpRequest, exc: HTTPException):
        return error_response(RequestError(exc.status_code, exc.detail or "not found"))

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


# ---- command line -----------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("pte")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--tokenizer", help="tokenizer.json (default: the one next to the .pte)")
    p.add_argument("--model-name", help="the model id clients name (default: the .pte's file name without .pte)")
    p.add_argument("--parallel", type=int, default=1, help="program instances, each with its own KV cache")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait for a free instance; more get 503 with Retry-After")
    add_template_option(p, "the chat template of /v1/chat/completions, in place of the one saved with the program")


def cmd_serve(args) -> int:
    import sys

    import uvicorn

    from llmcore.runtime.generate import tokenizer_beside

    if args.parallel < 1 or args.max_queue < 0:
        raise LlmcoreError("--parallel must be at least 1 and --max-queue at least 0.", stage="serve",
                           fix="pass --parallel 1 (the default) or more.")
    tokenizer_path = str(args.tokenizer or tokenizer_beside(args.pte))
    template = load_template(tokenizer_path, args.chat_template)  # before the programs load: a bad one fails fast
    engines = [Engine(args.pte, tokenizer_path) for _ in range(args.parallel)]
    server = Server(engines, args.model_name or Path(args.pte).stem, template, args.max_queue)
    print(f"[llmcore] serving {args.pte} as {server.model_id!r} ({args.parallel} instance"
          f"{'s' * (args.parallel != 1)}) on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="warning")
    return 0
