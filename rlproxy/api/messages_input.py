"""The Anthropic Messages request: parsed once at the edge, translated to the internal chat request.

Owns Anthropic's request shapes (pydantic, strict like protocol.py; vendor fields ignored) and
their translation into `protocol.ChatRequest`: `system` (and Claude Code's `system` messages
between turns) become system messages, `tool_use` blocks an assistant message's `tool_calls`,
each `tool_result` a `tool` message, `tools[].input_schema` a function's `parameters`. Bad input
raises APIError(400) naming the offending field (app.py renders it in Anthropic's shape).
Knows nothing of HTTP, generation or sessions.

Accepted and dropped: the `thinking` config and thinking blocks echoed in the history,
`cache_control`, `citations`, `output_config.effort`, `context_management`. Tools with a
versioned `type` (server tools such as web_search_20250305, and Anthropic-defined ones such as
bash_20250124, whose schema the model cannot be shown) are taken out by `drop_server_tools`
under `--hosted-tools drop` (the default) and are a 400 under `reject`; any other type but
"custom" (or none) is a 400 under either.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from rlproxy import protocol
from rlproxy.protocol import APIError, ChatRequest, json_int, shown

TEXT_JOIN = "\n\n"  # between text blocks of one message: Anthropic has no separator of its own
MEDIA_BLOCKS = {"image", "document", "search_result"}

_CONFIG = ConfigDict(strict=True, extra="ignore")  # as protocol.py: typed, vendor fields ignored


class TextBlock(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = _CONFIG
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = _CONFIG
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False


class InputMessage(BaseModel):
    model_config = _CONFIG
    # "system" between turns: Claude Code sends it (beta mid-conversation-system-2026-04-07)
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class ToolDef(BaseModel):
    model_config = _CONFIG
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools name a version here


class ToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Metadata(BaseModel):
    model_config = _CONFIG
    user_id: str | None = None


class OutputConfig(BaseModel):
    model_config = _CONFIG
    effort: str | None = None  # accepted, ignored
    format: dict[str, Any] | None = None


class CountTokensRequest(protocol.SessionFields):
    """A /v1/messages/count_tokens body (what is templated); MessagesRequest adds generation."""

    model_config = _CONFIG
    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None  # accepted, ignored: no separate thinking budget


class MessagesRequest(CountTokensRequest):
    """A validated /v1/messages body. `max_tokens` is required, as Anthropic requires it."""

    max_tokens: json_int(1)
    # at most 4, non-empty: the internal request's limits (OpenAI's), named here in these terms
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=4)
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: json_int(0) | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    stream: bool = False
    # an extension (Messages has none): as Chat Completions' logit_bias, checked there
    logit_bias: dict[str, Any] | None = None


def _block(raw: dict, where: str):
    """One content block, typed; None for a block that is accepted and dropped."""
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise APIError(400, f"{where}.type: a content block needs a string type",
                       param=f"{where}.type")
    if kind in ("thinking", "redacted_thinking"):
        return None  # the model's earlier reasoning: never templated back (as Qwen3 drops it)
    if kind in MEDIA_BLOCKS:
        raise APIError(400, f"{where}: this model reads text only; a {shown(kind)} block cannot be "
                       "used (send its text instead)", param=where)
    cls = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock}.get(kind)
    if cls is None:
        raise APIError(400, f"{where}.type: unknown or unsupported content block type "
                       f"{shown(kind)}; expected text, tool_use, tool_result, thinking or "
                       "redacted_thinking", param=f"{where}.type")
    return protocol.validate(cls, raw, prefix=where)


def _text(parts: str | list, where: str) -> str:
    """System or tool_result content (a string, or blocks raw or parsed) as one string."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, p in enumerate(parts):
        block = _block(p, f"{where}[{j}]") if isinstance(p, dict) else p
        if block is None:  # a dropped (thinking) block
            continue
        if not isinstance(block, TextBlock):
            raise APIError(400, f"{where}[{j}]: only text blocks may appear here",
                           param=f"{where}[{j}]")
        texts.append(block.text)
    return TEXT_JOIN.join(texts)


def _messages(req: CountTokensRequest) -> list[dict]:
    """Anthropic's message list as OpenAI chat messages (the internal shape)."""
    out_msgs: list[dict] = []
    if req.system:
        out_msgs.append({"role": "system", "content": _text(req.system, "system")})
    tool_use_ids: set[str] = set()
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        raw = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        if not raw:
            raise APIError(400, f"{where}: a message needs at least one content block",
                           param=where)
        blocks = [_block(b, f"{where}[{j}]") for j, b in enumerate(raw)]
        if m.role == "assistant":
            out_msgs.append(_assistant(blocks, tool_use_ids, where))
        elif m.role == "system":
            out_msgs.append({"role": "system", "content": _text(blocks, where)})
        else:
            out_msgs += _user(blocks, tool_use_ids, where)
    if req.messages[-1].role == "assistant":
        # A prefilled answer would need the template to continue the last message, not open
        # a new one; say so rather than silently answer from scratch.
        raise APIError(400, "messages: the last message must be a user message; continuing a "
                       "prefilled assistant message is not supported by rlproxy",
                       param="messages")
    return out_msgs


def _assistant(blocks: list, tool_use_ids: set[str], where: str) -> dict:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            tool_use_ids.add(b.id)
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name,
                                       "arguments": orjson.dumps(b.input).decode()}})
        elif isinstance(b, ToolResultBlock):
            raise APIError(400, f"{where}[{j}]: tool_result blocks belong in user messages",
                           param=f"{where}[{j}]")
    msg: dict[str, Any] = {"role": "assistant", "content": TEXT_JOIN.join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list, tool_use_ids: set[str], where: str) -> list[dict]:
    """Tool results become `tool` messages, text between them `user` messages, in order."""
    msgs: list[dict] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            raise APIError(400, f"{where}[{j}]: tool_use blocks belong in assistant messages",
                           param=f"{where}[{j}]")
        elif isinstance(b, ToolResultBlock):
            if b.tool_use_id not in tool_use_ids:
                raise APIError(400, f"{where}[{j}].tool_use_id: no earlier tool_use block has "
                               f"the id {shown(b.tool_use_id)}", param=f"{where}[{j}].tool_use_id")
            if texts:
                msgs.append({"role": "user", "content": TEXT_JOIN.join(texts)})
                texts = []
            content = _text(b.content, f"{where}[{j}].content")
            # The template has no error flag: say it in the text the model (and the judge) reads.
            msgs.append({"role": "tool", "tool_call_id": b.tool_use_id,
                         "content": f"Error: {content}" if b.is_error else content})
    if texts or not msgs:
        msgs.append({"role": "user", "content": TEXT_JOIN.join(texts)})
    return msgs


SERVER_TOOL_TYPE = re.compile(r"[a-z_]+_\d{8}")  # web_search_20250305, bash_20250124 ...


def server_tool(t: ToolDef) -> bool:
    """A tool of Anthropic's versioned types (server tools, Anthropic-defined client tools):
    --hosted-tools drop leaves these out. Another unknown type stays, for _tools' 400."""
    return t.type is not None and SERVER_TOOL_TYPE.fullmatch(t.type) is not None


def drop_server_tools(req: CountTokensRequest) -> list[str]:
    """--hosted-tools drop: take the server tools out of `req.tools`; returns their types."""
    dropped = [t.type for t in req.tools or [] if server_tool(t)]
    if dropped:
        req.tools = [t for t in req.tools if not server_tool(t)] or None
    return dropped


def _tools(req: CountTokensRequest) -> tuple[list | None, Any, bool]:
    """tools, tool_choice and parallel_tool_calls in Chat Completions terms."""
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if server_tool(t):
                raise APIError(400, f"tools[{i}].type: server tool {shown(t.type)} is not "
                               "supported by rlproxy (--hosted-tools reject; --hosted-tools drop "
                               "leaves it out of the prompt); define it as a custom tool with an "
                               "input_schema", param=f"tools[{i}].type")
            if t.type not in (None, "custom"):
                raise APIError(400, f"tools[{i}].type: {shown(t.type)} is not a tool type; "
                               "define the tool with a name and an input_schema (type absent "
                               "or \"custom\")", param=f"tools[{i}].type")
            if t.input_schema is None:
                raise APIError(400, f"tools[{i}].input_schema: Field required",
                               param=f"tools[{i}].input_schema")
            fn = {"name": t.name, "description": t.description, "parameters": t.input_schema}
            tools.append({"type": "function",
                          "function": {k: v for k, v in fn.items() if v is not None}})
    choice, parallel = req.tool_choice, True
    if choice is None:
        return tools, None, parallel
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice.name: Field required", param="tool_choice.name")
        return tools, {"type": "function", "function": {"name": choice.name}}, parallel
    return tools, {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def to_chat_request(req: CountTokensRequest,
                    max_depth: int = protocol.MAX_JSON_DEPTH) -> ChatRequest:
    """The internal request this Messages body stands for; checked again by protocol.py."""
    tools, tool_choice, parallel = _tools(req)
    body: dict[str, Any] = {
        "model": req.model, "messages": _messages(req), "tools": tools,
        "tool_choice": tool_choice, "parallel_tool_calls": parallel,
        "session_id": req.session_id, "turn_type": req.turn_type,
        "session_done": req.session_done,
    }
    if isinstance(req, MessagesRequest):
        if req.output_config and req.output_config.format:
            raise APIError(400, "output_config.format: structured outputs are not supported: "
                           "rlproxy does not constrain output to a schema; ask for JSON in the "
                           "prompt instead", param="output_config.format")
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    stream=req.stream, user=req.metadata.user_id if req.metadata else None,
                    logit_bias=req.logit_bias)
    return protocol.validate(ChatRequest, body, rename=anthropic_param, max_depth=max_depth)


# The internal chat request's fields, as a Messages request names them. Messages are renumbered
# (system prompts, tool results split out), so they are just `messages`.
CHAT_TO_ANTHROPIC = ((re.compile(r"^tools(\[\d+\])\.function\.parameters"),
                      r"tools\1.input_schema"),
                     (re.compile(r"^tools(\[\d+\])\.function"), r"tools\1"),
                     (re.compile(r"^tool_choice\.function"), "tool_choice"),
                     (re.compile(r"^stop\b"), "stop_sequences"),
                     (re.compile(r"^messages\b.*"), "messages"))


def anthropic_param(path: str) -> str:
    for pattern, name in CHAT_TO_ANTHROPIC:
        path = pattern.sub(name, path)
    return path
