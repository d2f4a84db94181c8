"""From messages and tools to prompt token ids, for every model, with or without tool support.

Owns: `render_prompt` (the one way a conversation becomes prompt ids: requests, the scorer's
teacher prompts, eval prompts), whether a model's chat template renders tools (probed once per
tokenizer), and the fallback tool format for templates that do not, with the tool-call format
the model's output is parsed in (`tool_format`). Does not own parsing requests (protocol.py) or
turning output into tool calls (serving/choice_text.py, which asks `tool_format` what to look for).

A template renders tools when, given a probe tool and a probe assistant tool call, both names
appear in its output. One that does renders exactly as `apply_chat_template` always did.

The fallback format, for templates that do not (SmolLM2's, for one), is the Qwen2.5/Hermes
format that the embedded tiny model's template uses, written into plain messages that any
template renders:

- Tools (when the request offers any): appended to the first message if it is a system (or
  developer) message, after a blank line, else a system message of their own at the start:

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
      </tools>

      For each function call, return a json object with function name and arguments within
      <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

  (one tool per line inside <tools>; the instruction is one line in the prompt.)
- An assistant message's tool calls: its content (if any), then one block per call, each
  on its own line, in the assistant message's content:

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- Tool results: a run of consecutive tool messages becomes one user message holding one
  block per result, each ending in a newline:

      <tool_response>
      {"temperature": 21}
      </tool_response>

- In a conversation rendered this way every message's content is a string: None becomes "",
  a list of parts the text of its text parts.

The model's reply is read back with mlx-lm's `json_tools` parser: each
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block becomes an OpenAI tool call.
Conversations without tools, tool calls or tool results render as they always did.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable

from mlx_lm.tool_parsers import json_tools

log = logging.getLogger("rlproxy.chat_template")

TOOLS_SECTION = """\
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

# Names no real conversation holds, so seeing them in the output means the template rendered them.
_PROBE_TOOL = "rlproxy_probe_tool_7f3a"
_PROBE_CALL = "rlproxy_probe_call_7f3a"
_PROBE_ID = "rlprobe01"  # 9 alphanumerics: Mistral's templates refuse other call ids


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes a tool call: the block's markers and the parser for what is between."""

    start: str
    end: str | None  # None: the call runs to the end of the completion
    parser: Callable[[str, list[dict] | None], Any]


FALLBACK_FORMAT = ToolFormat(json_tools.tool_call_start, json_tools.tool_call_end,
                             json_tools.parse_tool_call)


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt ids for MESSAGES (plain dicts, OpenAI-shaped) offering TOOLS, ending in the
    assistant's generation prompt. The template's own tool rendering where it has one, else
    the fallback format above. Raises what the template raises on messages it refuses."""
    if (tools or has_tool_turns(messages)) and not supports_tools(tokenizer):
        messages, tools = fallback_messages(messages, tools), None
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True))


def tool_format(tokenizer) -> ToolFormat | None:
    """What to parse the model's tool calls from: mlx-lm's format for the model where its
    template renders tools (None when mlx-lm knows none), else the fallback format."""
    if not supports_tools(tokenizer):
        return FALLBACK_FORMAT
    if tokenizer.tool_call_start is None:
        return None
    return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser)


def has_tool_turns(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


@functools.lru_cache(maxsize=16)
def supports_tools(tokenizer) -> bool:
    """Does the chat template render both a tool's schema and an assistant's tool call? Probed
    once per tokenizer; a template that raises on the probe does not."""
    tools = [{"type": "function", "function": {
        "name": _PROBE_TOOL, "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": _PROBE_ID, "type": "function",
            "function": {"name": _PROBE_CALL, "arguments": {"x": 1}}}]},
        {"role": "tool", "tool_call_id": _PROBE_ID, "content": "1"},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True)
        supported = _PROBE_TOOL in text and _PROBE_CALL in text
    except Exception:  # jinja raises on what the template refuses
        supported = False
    if not supported:
        log.info("the chat template of %s does not render tools: tools, tool calls and tool "
                 "results go into the prompt in rlproxy's fallback format (<tools>, "
                 "<tool_call>, <tool_response>; see rlproxy/serving/chat_template.py)",
                 tokenizer.name_or_path)
    return supported


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """MESSAGES with TOOLS, tool calls and tool results written into plain text messages in
    the fallback format; other messages keep their keys, with their content made a string."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m.get("role") == "tool":
            block = f"<tool_response>\n{text_of(m.get('content'))}\n</tool_response>\n"
            if i and messages[i - 1].get("role") == "tool":  # the run of results goes on
                out[-1]["content"] += block
            else:
                out.append({"role": "user", "content": block})
        elif m.get("tool_calls"):
            parts = [text_of(m.get("content"))] + [_call_block(c) for c in m["tool_calls"]]
            out.append({"role": m["role"], "content": "\n".join(p for p in parts if p)})
        else:
            out.append({**m, "content": text_of(m.get("content"))})
    if tools:
        section = TOOLS_SECTION.format(
            tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            first = out[0]["content"]
            out[0] = {**out[0], "content": f"{first}\n\n{section}" if first else section}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def text_of(content: Any) -> str:
    """A message's content as text: None is "", a list of parts the text of its text parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p["text"] for p in content
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
    return str(content)


def _call_block(call: dict) -> str:
    fn = call["function"]
    arguments = fn.get("arguments") or {}
    if isinstance(arguments, str):  # OpenAI sends JSON text; the block holds the object
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    body = json.dumps({"name": fn["name"], "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"
