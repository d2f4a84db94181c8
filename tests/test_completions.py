"""Per-choice text assembly on real parts: the embedded tokenizer, mlx-lm's TokenizerWrapper and
its real tool parsers, token by token as the engine would deliver them."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tool_parsers import qwen3_coder
from transformers import AutoTokenizer

from rlproxy.serving.choice_text import ChoiceText, token_bytes
from rlproxy.serving.embedded_model import embedded_model_path

ADD = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "number"}, "note": {"type": "string"}}}}}]
XML_CALL = ("<tool_call>\n<function=add>\n<parameter=a>\n5\n</parameter>\n<parameter=b>\n2.5\n"
            "</parameter>\n<parameter=note>\n7\n</parameter>\n</function>\n</tool_call>")


def feed(tok, text, **kw) -> ChoiceText:
    ct = ChoiceText(tok, kw.pop("stop", None), kw.pop("parse_tools", False), **kw)
    for i in tok.encode(text, add_special_tokens=False):
        ct.add(i)
    if not ct.stopped:
        ct.finish()
    return ct


@pytest.fixture(scope="module")
def xml_tok():
    """The embedded tokenizer with Qwen3-Coder's XML tool-call format and mlx-lm's parser for it,
    which reads argument types from the request's tool schemas."""
    hf = AutoTokenizer.from_pretrained(embedded_model_path("tiny"))
    return TokenizerWrapper(hf, tool_call_start=qwen3_coder.tool_call_start,
                            tool_call_end=qwen3_coder.tool_call_end,
                            tool_parser=qwen3_coder.parse_tool_call)


def test_tool_arguments_are_typed_from_the_request_schema(xml_tok):
    ct = feed(xml_tok, "Sure. " + XML_CALL, parse_tools=True, tools=ADD)
    assert ct.text == "Sure. "
    (call,) = ct.tool_calls
    assert call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 5, "b": 2.5, "note": "7"}
    untyped = feed(xml_tok, XML_CALL, parse_tools=True)  # no schema: the parser keeps text
    assert json.loads(untyped.tool_calls[0]["function"]["arguments"])["a"] == "5"


def test_a_block_the_parser_rejects_stays_text(tiny):
    text = "<tool_call>\nnot json\n</tool_call> after"
    ct = feed(tiny.tokenizer, text, parse_tools=True)
    assert (ct.text, ct.tool_calls) == (text, [])


@pytest.mark.parametrize("stop,text,sequence", [
    (["city", "Paris"], "Hello from ", "Paris"),  # the first to complete in the text
    (["om P"], "Hello fr", "om P"),  # across token boundaries
    (["nowhere"], "Hello from Paris, the city of light!", None),
])
def test_stop_strings_end_the_choice_and_say_which(tiny, stop, text, sequence):
    ct = feed(tiny.tokenizer, "Hello from Paris, the city of light!", stop=stop)
    assert (ct.text, ct.stop_sequence, ct.stopped) == (text, sequence, sequence is not None)


def test_token_bytes_rebuild_the_text_exactly(tiny):
    tok = tiny.tokenizer
    text = "naïve café — 東京 🚀 <tool_call> \t\n end"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()
