"""A Responses API request body: parsed once, and its input items turned into chat messages.

Owns the request shape of `POST /v1/responses` (`ResponsesRequest`) and the translation of
`instructions` + `input` items + `tools` + `tool_choice` into the internal `ChatRequest` that
every dialect hands to turns.py. Knows nothing of HTTP, the engine or the response store: the
caller passes in the conversation a `previous_response_id` stands for.

Input items, as chat messages: `message` -> a message of its role (text parts joined);
`function_call` -> a tool call on the assistant message before it (or a new one);
`function_call_output` -> a `tool` message; `reasoning` -> dropped (the model's own thinking is
not part of the conversation it is shown again, as in the chat templates). Anything else is a 400.

Tools of OpenAI's other types (hosted ones: web_search, file_search, code_interpreter, mcp ...;
and custom, which has no JSON schema) cannot be offered to the model: under `--hosted-tools
drop` (the default) `drop_hosted_tools` takes them out of the request, so the response's `tools`
echo lists what the model was offered; under `reject` they are a 400. A type OpenAI does not
have (a typo such as "functions", none at all) is a 400 under either.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from rlproxy import protocol
from rlproxy.protocol import APIError, ChatRequest, json_int, shown

TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}


class ResponsesRequest(protocol.SessionFields):
    """A validated /v1/responses body (fields this proxy does not use are ignored)."""

    # strict, as protocol.ChatRequest; extra="ignore": Codex and the SDKs send many options
    # (include, prompt_cache_key, service_tier, ...) that change nothing here.
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: json_int(1) | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None  # accepted and ignored: the model thinks or not
    text: dict[str, Any] | None = None
    # an extension (Responses has none): as Chat Completions' logit_bias, checked there
    logit_bias: dict[str, Any] | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _one_input_error(cls, v: Any, handler) -> Any:
        # The union's per-branch errors read badly; say what is allowed instead.
        try:
            return handler(v)
        except ValidationError:
            raise ValueError("must be a string or a list of input items (objects)") from None

    @model_validator(mode="after")
    def _check(self) -> "ResponsesRequest":
        if not self.input or (isinstance(self.input, str) and not self.input.strip()):
            raise APIError(400, "input: must not be empty", param="input")
        fmt = (self.text or {}).get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise APIError(400, f"text.format {shown(kind)} is not supported: this proxy does not "
                           "constrain output to JSON; ask for JSON in the prompt instead",
                           param="text.format", code="unsupported_parameter")
        return self


def input_messages(r: ResponsesRequest, history: list[dict]) -> list[dict]:
    """`history` (the stored conversation of previous_response_id) + this request's input, as
    chat messages (without `instructions`, which OpenAI does not carry over a chain)."""
    items = [{"type": "message", "role": "user", "content": r.input}] if isinstance(
        r.input, str) else r.input
    messages = [dict(m) for m in history]
    calls = {c["id"] for m in messages for c in m.get("tool_calls") or []}
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            calls.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or call_id not in calls:
                raise APIError(400, f"{where}.call_id: no function call found with call_id "
                               f"{shown(call_id)} in the input or the previous response",
                               param=f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}.type: input items of type {shown(kind)} are not "
                           "supported; rlproxy accepts message, function_call, "
                           "function_call_output and reasoning items", param=f"{where}.type",
                           code="unsupported_item_type")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(400, f"{where}.role: must be user, assistant, system or developer, "
                       f"not {shown(role)}", param=f"{where}.role")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined; any other part (image, file, audio) is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of content parts",
                       param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if not isinstance(kind, str) or kind not in TEXT_PARTS:
            raise APIError(400, f"{where}[{j}]: this model accepts text only; got a content part "
                           f"of type {shown(kind)}", param=f"{where}[{j}]")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise APIError(400, f"{where}[{j}]: a {kind} part needs a string text",
                           param=f"{where}[{j}]")
        texts.append(text)
    return "".join(texts)


def _function_call(item: dict, where: str) -> dict:
    name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
    for field, value in (("name", name), ("call_id", call_id), ("arguments", args)):
        if not isinstance(value, str):
            raise APIError(400, f"{where}.{field}: a function_call needs a string {field}",
                           param=f"{where}.{field}")
    try:
        parsed = orjson.loads(args) if args.strip() else {}
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise APIError(400, f"{where}.arguments: must be a JSON object encoded as a string",
                       param=f"{where}.arguments")
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": args if args.strip() else "{}"}}


# The OpenAI SDK's ToolParam types other than function and namespace (openai/types/responses/
# tool_param.py): run by OpenAI, or freeform (custom: no JSON schema to offer the model).
HOSTED_TYPES = frozenset((
    "file_search", "computer", "computer_use_preview", "mcp", "code_interpreter",
    "programmatic_tool_calling", "image_generation", "local_shell", "shell", "custom",
    "tool_search", "apply_patch"))
HOSTED_PREFIXES = ("web_search", "computer_use")  # dated versions: web_search_2025_08_26 ...


def hosted(tool) -> bool:
    """A tool of a known hosted type, which --hosted-tools drop leaves out. Anything else that
    is not a function (or namespace) stays, for chat_tools' 400 naming it: a typo such as
    "functions" or a missing type is the client's mistake, not a tool to drop."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    return isinstance(kind, str) and (kind in HOSTED_TYPES or kind.startswith(HOSTED_PREFIXES))


def drop_hosted_tools(r: ResponsesRequest) -> list[str]:
    """--hosted-tools drop: take the hosted tools out of `r.tools` (inside a namespace too; a
    namespace left empty goes as well) and return their types, in order."""
    dropped, kept = [], []
    for t in r.tools or []:
        if hosted(t):
            dropped.append(t["type"])
            continue
        if isinstance(t, dict) and t.get("type") == "namespace" and isinstance(
                t.get("tools"), list):
            inner = [x for x in t["tools"] if not hosted(x)]
            dropped += [x["type"] for x in t["tools"] if hosted(x)]
            if not inner and t["tools"]:
                continue
            t = {**t, "tools": inner}
        kept.append(t)
    if dropped and not kept and r.tool_choice == "required":  # a tool nothing here can run
        raise APIError(400, f"tool_choice: 'required', but every tool offered is hosted "
                       f"({', '.join(dropped)}), which rlproxy does not run (--hosted-tools "
                       "drop left none); offer a function tool", param="tool_choice")
    if dropped:
        r.tools = kept or None
    return dropped


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Flat Responses function tools -> Chat Completions tools. A `namespace` tool (a named group
    of function tools; Codex sends its sub-agent tools so) is flattened into its functions;
    hosted tools (web_search, file_search, ...) left here are a 400 (--hosted-tools reject)."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        group = t.get("tools") if t.get("type") == "namespace" else [t]
        if t.get("type") == "namespace" and not isinstance(t.get("name"), str):
            raise APIError(400, f"{where}.name: a namespace needs a string name",
                           param=f"{where}.name")
        if not isinstance(group, list):
            raise APIError(400, f"{where}.tools: a namespace needs a list of tools",
                           param=f"{where}.tools")
        for j, tool in enumerate(group):
            kind = tool.get("type") if isinstance(tool, dict) else None
            at = f"{where}.tools[{j}]" if t.get("type") == "namespace" else where
            if kind != "function" and hosted(tool):
                raise APIError(400, f"{at}.type: tool type {shown(kind)} is not supported; "
                               "rlproxy offers the model function tools only, which the client "
                               "runs, and refuses others under --hosted-tools reject "
                               "(--hosted-tools drop leaves them out of the prompt instead)",
                               param=f"{at}.type", code="unsupported_tool_type")
            if kind != "function":
                if not isinstance(tool, dict):
                    field, what = at, "a tool must be an object"
                else:
                    field = f"{at}.type"
                    what = "missing" if kind is None else f"{shown(kind)} is not a tool type"
                raise APIError(400, f"{field}: {what}; send function tools ({{\"type\": "
                               "\"function\", \"name\": ..., \"parameters\": {...}}) or a "
                               "namespace of them", param=field, code="invalid_value")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                  if k in tool}
            protocol.validate(protocol.FunctionDef, fn, prefix=at)  # named as sent, flat
            out.append({"type": "function", "function": fn})
    return out


def tool_namespaces(tools: list[dict] | None) -> dict[str, str]:
    """Function name -> the namespace it was offered in, for the `namespace` of its calls
    (of tools chat_tools has checked)."""
    return {fn["name"]: t["name"] for t in tools or [] if t.get("type") == "namespace"
            for fn in t["tools"]}


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    # A choice that forces a hosted tool is a demand nothing here can meet: a 400 under either
    # --hosted-tools, where an offered hosted tool is only one option the model is not given.
    raise APIError(400, f"tool_choice: {shown(kind)} is not supported; use 'none', 'auto', "
                   "'required' or {\"type\": \"function\", \"name\": ...} (rlproxy runs no "
                   "hosted tool: --hosted-tools drop only leaves offered ones out of the prompt)",
                   param="tool_choice")


def to_chat_request(r: ResponsesRequest, conversation: list[dict],
                    max_depth: int = protocol.MAX_JSON_DEPTH) -> ChatRequest:
    """The internal chat request: instructions as the system message, then the conversation
    (`max_depth`: --max-json-depth, for function_call arguments)."""
    system = [{"role": "system", "content": r.instructions}] if r.instructions else []
    body = {"model": r.model, "messages": system + conversation, "tools": chat_tools(r.tools),
            "tool_choice": chat_tool_choice(r.tool_choice),
            "parallel_tool_calls": r.parallel_tool_calls, "max_tokens": r.max_output_tokens,
            "temperature": r.temperature, "top_p": r.top_p, "stream": r.stream, "user": r.user,
            "logit_bias": r.logit_bias,
            "session_id": r.session_id, "turn_type": r.turn_type,
            "session_done": r.session_done}
    return protocol.validate(ChatRequest, body, rename=responses_param, max_depth=max_depth)


CHAT_TO_RESPONSES = {"messages": "input", "max_tokens": "max_output_tokens"}


def responses_param(path: str) -> str:
    """A field of the internal chat request, named as a Responses request names it. Messages
    are renumbered (instructions, the previous response's turns), so they are just `input`."""
    head = re.match(r"\w+", path).group()
    if head in CHAT_TO_RESPONSES:
        return CHAT_TO_RESPONSES[head]
    return path
