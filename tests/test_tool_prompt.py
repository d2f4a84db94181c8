"""Tools in the prompt of a model whose chat template has no tool support (SmolLM2's), in the
fallback format of rlproxy/serving/chat_template.py: rendered with the real tokenizers, served by the
real app with the real model, and the model's calls read back as tool calls."""

from __future__ import annotations

import json
import logging

import pytest
import requests
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import AutoTokenizer

from rlproxy.appkeys import SESSIONS
from rlproxy.serving.chat_template import FALLBACK_FORMAT
from rlproxy.serving.chat_template import render_prompt
from rlproxy.serving.chat_template import supports_tools
from rlproxy.serving.chat_template import tool_format
from rlproxy.serving.choice_text import ChoiceText

from conftest import TOOL_PROMPT, TOOL_REPLY, TOOLS, read_records, server_with

CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Tell the local time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
TWO_TOOLS = TOOLS + [CLOCK]
CALL_BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RESULT = '{"temperature": 21}'


def history(content=None, arguments='{"city": "Paris"}') -> list[dict]:
    """TOOL_PROMPT, the assistant's call to get_weather (content as given, arguments as OpenAI
    sends them) and the tool's result."""
    return TOOL_PROMPT + [
        {"role": "assistant", "content": content, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ]


def prompt_text(tok, messages, tools) -> str:
    return tok.decode(render_prompt(tok, messages, tools))


# ---- rendering, with the real tokenizers ----

def test_smollm2_has_no_tool_support_and_the_tiny_model_has(real, tiny):
    assert not supports_tools(real.tokenizer)
    assert tool_format(real.tokenizer) == FALLBACK_FORMAT
    assert supports_tools(tiny.tokenizer)
    assert tool_format(tiny.tokenizer).parser is tiny.tokenizer.tool_parser


@pytest.mark.parametrize("system", [None, "Be brief."])
def test_every_schema_reaches_the_prompt_in_one_system_message(real, system):
    messages = ([{"role": "system", "content": system}] if system else []) + TOOL_PROMPT
    text = prompt_text(real.tokenizer, messages, TWO_TOOLS)
    for t in TWO_TOOLS:
        assert t["function"]["name"] in text and t["function"]["description"] in text
        assert json.dumps(t) in text  # the whole schema, parameters too
    assert "<tool_call>" in text and "<tools>" in text
    assert text.count("<|im_start|>system") == 1
    if system:  # merged into the caller's system message, which comes first
        assert text.startswith(f"<|im_start|>system\n{system}\n\n# Tools")
    assert text.endswith("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
                         "<|im_start|>assistant\n")


@pytest.mark.parametrize("content", [None, "", "Let me look.",
                                     [{"type": "text", "text": "Let me look."}]])
@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_an_earlier_call_and_its_result_survive_into_the_next_prompt(real, content, arguments):
    text = prompt_text(real.tokenizer, history(content, arguments), TOOLS)
    said = "Let me look.\n" if content else ""
    assert f"<|im_start|>assistant\n{said}{CALL_BLOCK}<|im_end|>" in text
    assert f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response>\n<|im_end|>" in text
    assert "<|im_start|>tool" not in text  # a role SmolLM2 never saw


def test_consecutive_results_share_one_user_message(real):
    messages = history() + [{"role": "tool", "tool_call_id": "call_2", "content": "22"}]
    text = prompt_text(real.tokenizer, messages, TOOLS)
    assert (f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response>\n"
            "<tool_response>\n22\n</tool_response>\n<|im_end|>") in text


def test_history_without_offered_tools_keeps_its_calls(real):
    # tool_choice "none" offers no tools, but the conversation's calls are still in it
    text = prompt_text(real.tokenizer, history(), None)
    assert CALL_BLOCK in text and RESULT in text and "<tools>" not in text


def test_conversations_without_tools_render_as_before(real):
    tok = real.tokenizer
    for messages in (TOOL_PROMPT, [{"role": "system", "content": "Hi."}] + TOOL_PROMPT):
        assert render_prompt(tok, messages, None) == \
            list(tok.apply_chat_template(messages, add_generation_prompt=True))


@pytest.mark.parametrize("messages,tools", [
    (TOOL_PROMPT, None),
    (TOOL_PROMPT, TWO_TOOLS),
    ([{"role": "system", "content": "Be brief."}] + TOOL_PROMPT, TOOLS),
    (history(None, {"city": "Paris"}), TOOLS),
    (history("Let me look.", {"city": "Paris"}) + [
        {"role": "tool", "tool_call_id": "call_2", "content": "22"}], TOOLS),
])
def test_a_template_with_tool_support_renders_byte_for_byte_as_before(tiny, messages, tools):
    tok = tiny.tokenizer
    assert render_prompt(tok, messages, tools) == \
        list(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True))


def test_the_fallback_is_logged_once_per_tokenizer(real, caplog):
    fresh = TokenizerWrapper(AutoTokenizer.from_pretrained(real.tokenizer.name_or_path))
    with caplog.at_level(logging.INFO, logger="rlproxy.chat_template"):
        for _ in range(3):
            render_prompt(fresh, TOOL_PROMPT, TOOLS)
    lines = [r for r in caplog.records if "does not render tools" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO


# ---- the model's calls, read back ----

def read(tok, text: str, parse_tools: bool = True) -> ChoiceText:
    ct = ChoiceText(tok, None, parse_tools, tools=TOOLS)
    for i in tok.encode(text, add_special_tokens=False):
        ct.add(i)
    ct.finish()
    return ct


def test_a_call_in_the_fallback_format_becomes_a_tool_call(real):
    ct = read(real.tokenizer, "Checking. " + TOOL_REPLY)
    assert ct.text == "Checking. "
    (call,) = ct.tool_calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert read(real.tokenizer, TOOL_REPLY, parse_tools=False).text == TOOL_REPLY


def test_what_the_prompt_shows_is_what_the_parser_reads(real):
    """A call rendered into the prompt, read back by the parser, is the call sent."""
    text = prompt_text(real.tokenizer, history(), TOOLS)
    block = text[text.index("<tool_call>\n{\"name\": \"get_weather\""):]
    block = block[:block.index("</tool_call>") + len("</tool_call>")]
    (call,) = read(real.tokenizer, block).tool_calls
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == \
        ("get_weather", {"city": "Paris"})


# ---- through the real server, with SmolLM2 ----

real_server = server_with("real", model="smollm2-135m-instruct")


def recorded_prompts(server, sid: str, tok) -> list[str]:
    """The decoded prompt ids of SID's turns, as recorded once the session ended."""
    assert requests.post(f"{server.base_url}/sessions/{sid}/end").status_code == 200
    server.app[SESSIONS].flushed().result(timeout=30)
    turns = sorted((r for r in read_records(server.settings.records.data_dir)
                    if r["session_id"] == sid), key=lambda r: r["index"])
    return [tok.decode(t["prompt_ids"]) for t in turns]


@pytest.mark.real_model
def test_served_prompts_hold_the_schemas_the_calls_and_the_results(real_server, real):
    c, sid = real_server.client(), "tool-prompt-1"
    for messages in (TOOL_PROMPT, history()):
        c.chat.completions.create(model="m", messages=messages, tools=TWO_TOOLS, max_tokens=1,
                                  extra_headers={"X-Session-Id": sid})
    before, after = recorded_prompts(real_server, sid, real.tokenizer)
    for t in TWO_TOOLS:
        assert t["function"]["name"] in before and t["function"]["description"] in before
    assert CALL_BLOCK in after and f"<tool_response>\n{RESULT}\n</tool_response>" in after
    assert "<tools>" in after and "<|im_start|>tool" not in after


@pytest.mark.real_model
def test_smollm2_calls_a_tool_and_it_comes_back_as_tool_calls(real_server):
    """Greedy SmolLM2 repeats the call an earlier turn made, in the fallback format (each
    token's lead over the next is over 1 nat), and the server returns it as a tool call."""
    r = real_server.client().chat.completions.create(
        model="m", messages=history()[:2] + TOOL_PROMPT, tools=TOOLS, max_tokens=40,
        temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
