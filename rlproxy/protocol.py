"""OpenAI Chat Completions shapes, parsed once at the edge.

Owns: parsing and validating a request body into a typed `ChatRequest`, the
OpenAI error shape (`APIError`), `json_response` (the one way a handler answers
JSON, the dashboard's too), the plain dicts handed to a HF chat template, and
builders for response and stream-chunk dicts. It knows nothing about MLX,
tokenizers or sessions; `session_id`/`turn_type`/`session_done` are only
carried through for the session layer to read.
"""

import re
import reprlib
import secrets
from typing import Annotated, Any, Callable, Literal, TypeVar

import orjson
from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, \
    ValidationInfo, field_validator, model_validator

MAX_JSON_DEPTH = 64  # settings.server.max_json_depth's default, for callers without settings
JSON_INT_MIN, JSON_INT_MAX = -2**63, 2**64 - 1  # the integers orjson reads and writes


class APIError(Exception):
    """A 4xx (or 5xx) answer in OpenAI's error shape; `headers` go on the response (Allow,
    Retry-After)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


def json_response(data, status: int = 200, headers=None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json",
                        headers=headers)


# strict: OpenAI rejects "1" for a number and 1 for a boolean, so we do too.
# extra="ignore": agents send vendor fields we must not choke on.
_CONFIG = ConfigDict(strict=True, extra="ignore")
# Used with fullmatch: `$` would also match before a final newline.
_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_TOKEN_ID = re.compile(r"[0-9]{1,10}")

# A client's value inside an error message: bounded in size and nesting (reprlib never recurses
# past maxlevel, so a 1,000-deep list is "[[[[...]]]]", not a RecursionError).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 60, 60
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 4


def shown(value: Any, limit: int = 100) -> str:
    """repr(value) for an error message, at most `limit` characters whatever the client sent."""
    try:
        text = _SHOWN.repr(value)
    except ValueError:  # an int past Python's 4,300-digit str limit
        text = f"<{type(value).__name__}>"
    return clip(text, limit)


def clip(text: str, limit: int = 100) -> str:
    """A client's text (a path, a header) cut to `limit` characters for an error message."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def json_depth(value: Any) -> int:
    """Nesting depth of decoded JSON ({} and [] count 1, a scalar 0), without recursion."""
    deepest, stack = 0, [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return deepest


def too_deep(limit: int, what: str = "the JSON body", param: str | None = None) -> APIError:
    return APIError(400, f"{what} is nested more than {limit} levels deep (--max-json-depth)",
                    param=param, code="json_too_deep")


def load_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """A request body as a JSON object, at most `max_depth` levels deep; else APIError(400).
    Deeper JSON would break later: orjson refuses to write past 254 levels when the turn is
    recorded, and Python's recursion limit ends jinja's tojson and repr."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        if "depth limit" in str(e):  # orjson stops at 1,024 levels
            raise too_deep(max_depth) from None
        raise APIError(400, f"could not parse the JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the JSON body must be an object, got {type(data).__name__}")
    if json_depth(data) > max_depth:
        raise too_deep(max_depth)
    return data


class FunctionCall(BaseModel):
    model_config = _CONFIG
    name: str
    arguments: str  # JSON text, as OpenAI sends it; checked to be an object

    @field_validator("arguments")
    @classmethod
    def _arguments_are_object(cls, v: str, info: ValidationInfo) -> str:
        if not v.strip():  # some clients send "" for a call without arguments
            return "{}"
        limit = (info.context or {}).get("max_json_depth", MAX_JSON_DEPTH)
        try:
            parsed = orjson.loads(v)
        except orjson.JSONDecodeError as e:
            if "depth limit" in str(e):
                raise ValueError(f"arguments are nested more than {limit} levels deep") from None
            raise ValueError(f"arguments must be a JSON object encoded as a string ({e})") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be a JSON object encoded as a string")
        # JSON inside a string escapes the body's depth check; it is recorded as an object
        if json_depth(parsed) > limit:
            raise ValueError(f"arguments are nested more than {limit} levels deep "
                             "(--max-json-depth)")
        return v


def json_int(ge: int = JSON_INT_MIN, le: int = JSON_INT_MAX) -> Any:
    """A request's integer field: ge..le, 64 bits at most. `json_int(1) | None` if optional."""
    def as_sent(v: Any) -> Any:  # orjson reads an integer past its bounds as a float
        if type(v) is float and v.is_integer() and not JSON_INT_MIN < v <= JSON_INT_MAX:
            return JSON_INT_MAX + 1 if v > 0 else JSON_INT_MIN - 1  # the bound check says so
        return v
    return Annotated[int, BeforeValidator(as_sent), Field(ge=ge, le=le)]


class ToolCall(BaseModel):
    model_config = _CONFIG
    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(BaseModel):
    model_config = _CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None  # text parts are joined into one string on parse
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # accepted from agents that echo it, never used

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        texts = []
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError("this model accepts text only; got a content part of type "
                                 f"{shown(kind)}")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(part["text"])
        return "".join(texts)


class FunctionDef(BaseModel):
    model_config = _CONFIG
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        if not _TOOL_NAME.fullmatch(v):
            raise ValueError("must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'")
        return v


class Tool(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _CONFIG
    name: str


class NamedToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = _CONFIG
    type: str


class SessionFields(BaseModel):
    """What every API's request body shares: the session protocol's body fallbacks (for
    clients that cannot set headers; see sessions/store.py), and explicit nulls read as unset."""

    session_id: str | None = None
    turn_type: str | None = None
    session_done: bool | str | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # OpenAI SDKs and agents send explicit nulls for unset options.
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class ChatRequest(SessionFields):
    """A validated /v1/chat/completions body.

    `max_tokens` is the effective completion limit: `max_completion_tokens`
    wins when both are given. `stop` is always a list (or None).
    """

    model_config = _CONFIG
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: json_int(0) | None = None  # not OpenAI's: vLLM's extension, Anthropic's top_k
    n: json_int(1, 16) = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] | None = Field(None, max_length=4)
    max_tokens: json_int(1) | None = None
    max_completion_tokens: json_int(1) | None = None
    seed: json_int() | None = None
    logprobs: bool = False
    top_logprobs: json_int(0, 20) | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[int, float] | None = None  # token id -> bias; JSON keys are strings
    response_format: ResponseFormat | None = None
    user: str | None = None

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _one_tool_choice_error(cls, v: Any, handler) -> Any:
        # The union's per-branch errors read badly; say what is allowed instead.
        try:
            return handler(v)
        except ValidationError:
            raise ValueError('must be "none", "auto", "required" or '
                             '{"type": "function", "function": {"name": ...}}') from None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        v = [v] if isinstance(v, str) else v
        if isinstance(v, list) and any(s == "" for s in v):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_id_keys(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for key, bias in v.items():
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"keys must be token ids as integer strings, got {shown(key)}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise ValueError(f"bias for token {key} must be a number in [-100, 100], got "
                                 f"{shown(bias)}")
            out[int(key)] = float(bias)
        return out

    @model_validator(mode="after")
    def _check_across_fields(self) -> "ChatRequest":
        # Raised as APIError, which pydantic lets through untouched, so each
        # rule can name its own param (and code) precisely.
        for i, m in enumerate(self.messages):
            _check_message(i, m)
        if self.response_format is not None and self.response_format.type != "text":
            unsupported = self.response_format.type in ("json_object", "json_schema")
            raise APIError(
                400, f"response_format {shown(self.response_format.type)} is not supported: this "
                "proxy does not constrain output to JSON; ask for JSON in the prompt instead",
                param="response_format", code="unsupported_parameter" if unsupported else None)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when 'stream' is true",
                           param="stream_options")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: 'logprobs' must be true to request top_logprobs",
                           param="top_logprobs")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise APIError(400, "tool_choice: only 'none' or 'auto' is allowed when no tools are given",
                           param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {t.function.name for t in self.tools}:
                raise APIError(400, f"tool_choice: function {shown(name)} is not among the given "
                               "tools", param="tool_choice")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def _check_message(i: int, m: Message) -> None:
    """Role-specific rules a per-field type cannot express."""
    where = f"messages[{i}]"
    if m.role == "tool":
        if m.tool_call_id is None:
            raise APIError(400, f"{where}.tool_call_id: a tool message needs the id of the call it answers",
                           param=f"{where}.tool_call_id")
        if m.content is None:
            raise APIError(400, f"{where}.content: a tool message needs content", param=f"{where}.content")
    elif m.role == "assistant":
        if m.content is None and not m.tool_calls:
            raise APIError(400, f"{where}.content: an assistant message needs content or tool_calls",
                           param=f"{where}.content")
    elif m.content is None:
        raise APIError(400, f"{where}.content: a {m.role} message needs content", param=f"{where}.content")


# pydantic puts a union's branch ('session_done', 'bool') or a model's class name in an error's
# location; the client never wrote those, so `param` leaves them out.
_TYPE_TAG = re.compile(r"str|bool|int|float|none|[a-z-]+\[.*\]|[A-Z]\w*", re.S)


def error_path(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role', as OpenAI names params. A dict key the
    client chose (metadata's) is cut to 40 characters: a path is said back in the error."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not _TYPE_TAG.fullmatch(part):
            part = part if len(part) <= 40 else part[:37] + "..."
            path += f".{part}" if path else part
    return path


# pydantic's bound errors -> (the bound's key, OpenAI's words and code for it)
BOUNDS = {"less_than_equal": ("le", "at most", "above_max_value"),
          "less_than": ("lt", "less than", "above_max_value"),
          "greater_than_equal": ("ge", "at least", "below_min_value"),
          "greater_than": ("gt", "greater than", "below_min_value")}


def error_said(err: dict) -> tuple[str, str | None]:
    """(message, OpenAI's code) for a pydantic error: a number out of range says its bound."""
    if err["type"] not in BOUNDS:
        return err["msg"].removeprefix("Value error, "), None
    key, words, code = BOUNDS[err["type"]]
    bound = err["ctx"][key]  # a float field's is a float: 2.0 for le=2
    if isinstance(bound, float):
        return f"must be {words} {bound:g}", f"decimal_{code}"
    return f"must be {words} {bound}", f"integer_{code}"


def join_path(prefix: str, path: str) -> str:
    if not prefix or not path:
        return prefix or path
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


M = TypeVar("M", bound=BaseModel)


def validate(model: type[M], data: Any, *, prefix: str = "",
             rename: Callable[[str], str] | None = None,
             max_depth: int = MAX_JSON_DEPTH) -> M:
    """`model` from decoded JSON; a bad field raises APIError(400) naming it as the client wrote
    it: `prefix` places a nested part ('input[0]'), `rename` maps an internal request's field
    path to the dialect's own. A union's failed branches are said together. `max_depth` bounds
    JSON that arrives inside strings (tool-call arguments). Messages never carry the client's
    value itself beyond `shown`'s bound (pydantic's own messages name types, not values)."""
    try:
        return model.model_validate(data, context={"max_json_depth": max_depth})
    except ValidationError as e:
        errors = e.errors(include_url=False)
        first = error_path(errors[0]["loc"])
        said = dict.fromkeys(error_said(err) for err in errors
                             if error_path(err["loc"]) == first)
        path = join_path(prefix, rename(first) if rename and first else first)
        msg = " or ".join(m for m, _ in said)
        raise APIError(400, f"{path}: {msg}" if path else msg, param=path or None,
                       code=next(iter(said))[1] if len(said) == 1 else None) from None


def parse_body(raw: bytes, model: type[M], rename: Callable[[str], str] | None = None,
               max_depth: int = MAX_JSON_DEPTH) -> M:
    """A JSON request body as `model`; any bad input raises APIError(400)."""
    return validate(model, load_json(raw, max_depth), rename=rename, max_depth=max_depth)


def parse_chat_request(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> ChatRequest:
    """Parse a request body; any bad input raises APIError(400)."""
    return parse_body(raw, ChatRequest, max_depth=max_depth)


def template_messages(req: ChatRequest) -> list[dict]:
    """Messages as plain dicts for a HF chat template (tool arguments as dicts)."""
    out = []
    for m in req.messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": m.content or ""}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name,
                                             "arguments": orjson.loads(c.function.arguments)}}
                               for c in m.tool_calls]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def template_tools(req: ChatRequest) -> list[dict] | None:
    """Tools as plain dicts for a HF chat template, or None when none may be called."""
    if not req.tools or req.tool_choice == "none":
        return None
    # `strict` asks OpenAI's server for constrained decoding, which this proxy does not do; it
    # is no part of the tool the model reads, and SDKs differ in sending it (openai-agents
    # always does), so leaving it out gives one tool the same prompt through every client.
    return [t.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for t in req.tools]


# ---- response builders: plain dicts, ready for orjson ----

def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def chat_completion(id: str, created: int, model: str, choices: list[dict], usage: dict) -> dict:
    return {"id": id, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": "rlproxy", "choices": choices, "usage": usage}


def choice(index: int, content: str | None, tool_calls: list[dict] | None,
           finish_reason: str, logprobs: dict | None) -> dict:
    # OpenAI sends content null, not "", when the model only called tools.
    message: dict[str, Any] = {"role": "assistant",
                               "content": None if tool_calls and not content else content,
                               "refusal": None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chunk(id: str, created: int, model: str, choices: list[dict], usage: dict | None = None) -> dict:
    out = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
           "system_fingerprint": "rlproxy", "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def delta_choice(index: int, delta: dict, finish_reason: str | None = None,
                 logprobs: dict | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": 0}}


def token_logprob(token: bytes, logprob: float, top: list[tuple[bytes, float]]) -> dict:
    """One token's entry; `bytes` is exact even where a token holds part of a UTF-8 character."""
    def entry(b: bytes, lp: float) -> dict:
        return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}
    return {**entry(token, logprob), "top_logprobs": [entry(b, lp) for b, lp in top]}
