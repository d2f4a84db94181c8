"""--hosted-tools: tools the client's provider would run (Codex's web_search, Anthropic's server
tools), through the real openai and anthropic SDKs against the real server.

Under `drop` (the default) a Codex-shaped request is served, the model's prompt and the recorded
turn hold only the function tools, the response's `tools` echo omits the dropped ones, and one
WARNING per client says so. Under `reject` the same request is a 400 that names the flag.
"""

from __future__ import annotations

import logging
import time

import anthropic
import openai
import pytest

from conftest import read_records, server_with

SHELL = {"type": "function", "name": "shell", "description": "Runs a shell command",
         "parameters": {"type": "object", "properties": {"command": {
             "type": "array", "items": {"type": "string"}}}, "required": ["command"]}}
PLAN = {"type": "function", "name": "update_plan", "description": "Updates the plan",
        "parameters": {"type": "object", "properties": {"plan": {"type": "string"}}}}
# What Codex CLI 0.169 offers by default: its function tools and the hosted web_search.
CODEX_TOOLS = [SHELL, PLAN, {"type": "web_search"}]
CODEX = {"model": "gpt-5-codex", "instructions": "You are Codex.", "input": "list the files",
         "tools": CODEX_TOOLS, "tool_choice": "auto", "store": False, "max_output_tokens": 4,
         "extra_headers": {"User-Agent": "codex_cli_rs/0.169.0", "X-Session-Done": "1"}}
A_TOOL = {"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
SERVER_TOOL = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
MSG = [{"role": "user", "content": "Hi there"}]


drop_server = server_with()  # --hosted-tools drop, the default
reject_server = server_with(hosted_tools="reject")


def turns(server, api: str, n: int) -> list[dict]:
    """The recorded turns of `api`, once `n` are on disk (X-Session-Done files a turn at once,
    on the records writer's thread)."""
    deadline = time.time() + 15
    while True:
        found = [r for r in read_records(server.settings.records.data_dir) if r["api"] == api]
        if len(found) >= n or time.time() > deadline:
            assert len(found) == n, found
            return found
        time.sleep(0.05)


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and "offers tools rlproxy does not run" in r.getMessage()]


def test_codex_default_tools_are_served_without_web_search(drop_server, tiny, caplog):
    caplog.set_level(logging.WARNING, logger="rlproxy.server")
    client = drop_server.client()
    full = client.responses.create(**CODEX)
    assert full.status in ("completed", "incomplete")
    assert [t.name for t in full.tools] == ["shell", "update_plan"]  # the echo: what was offered
    events = list(client.responses.create(stream=True, **CODEX))
    assert [t.name for t in events[-1].response.tools] == ["shell", "update_plan"]
    said = warnings_in(caplog)
    assert len(said) == 1, said  # two requests, one client: one warning
    assert "web_search" in said[0] and "codex_cli_rs/0.169.0" in said[0]
    assert "--hosted-tools drop" in said[0]
    for turn in turns(drop_server, "responses", 2):
        assert [t["function"]["name"] for t in turn["tools"]] == ["shell", "update_plan"]
        prompt = tiny.tokenizer.decode(turn["prompt_ids"])
        assert '"shell"' in prompt and "web_search" not in prompt
    # another client is told too
    client.responses.create(**{**CODEX, "extra_headers": {"User-Agent": "another/1.0"}})
    assert len(warnings_in(caplog)) == 2
    client.responses.create(**{**CODEX, "extra_headers": {"X-Session-Id": "codex-1"}})
    client.responses.create(**{**CODEX, "extra_headers": {"X-Session-Id": "codex-1"}})
    assert len(warnings_in(caplog)) == 3  # a session id is a client of its own


def test_a_namespace_of_hosted_tools_goes_and_a_hosted_choice_is_a_400(drop_server):
    client = drop_server.client()
    r = client.responses.create(model="m", input="hi", max_output_tokens=2, tools=[
        SHELL, {"type": "namespace", "name": "n", "tools": [{"type": "file_search"}]}])
    assert [t.name for t in r.tools] == ["shell"]
    with pytest.raises(openai.BadRequestError) as e:  # forcing a tool nothing here can run
        client.responses.create(model="m", input="hi", max_output_tokens=2, tools=CODEX_TOOLS,
                                tool_choice={"type": "web_search_preview"})
    assert e.value.body["param"] == "tool_choice"
    assert "--hosted-tools drop" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # required, and every tool was hosted
        client.responses.create(model="m", input="hi", max_output_tokens=2,
                                tools=[{"type": "web_search"}], tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    assert "every tool offered is hosted (web_search)" in e.value.body["message"]


def test_anthropic_server_tools_are_dropped_too(drop_server, tiny, caplog):
    caplog.set_level(logging.WARNING, logger="rlproxy.server")
    claude = anthropic.Anthropic(base_url=drop_server.url, api_key="x", max_retries=0,
                                 default_headers={"User-Agent": "claude-cli/2.1.197"})
    counted = claude.messages.count_tokens(model="m", messages=MSG, tools=[A_TOOL, SERVER_TOOL])
    alone = claude.messages.count_tokens(model="m", messages=MSG, tools=[A_TOOL])
    assert counted.input_tokens == alone.input_tokens
    m = claude.messages.create(model="m", max_tokens=2, messages=MSG,
                               tools=[A_TOOL, SERVER_TOOL], extra_headers={"X-Session-Done": "1"})
    assert m.type == "message"
    (turn,) = turns(drop_server, "messages", 1)
    assert [t["function"]["name"] for t in turn["tools"]] == ["get_weather"]
    said = [w for w in warnings_in(caplog) if "claude-cli" in w]
    assert len(said) == 1 and "web_search_20250305" in said[0]


def test_reject_is_a_400_that_names_the_flag(reject_server, caplog):
    caplog.set_level(logging.WARNING, logger="rlproxy.server")
    with pytest.raises(openai.BadRequestError) as e:
        reject_server.client().responses.create(**CODEX)
    err = e.value.body
    assert err["code"] == "unsupported_tool_type" and err["param"] == "tools[2].type"
    assert "--hosted-tools" in err["message"] and "web_search" in err["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic.Anthropic(base_url=reject_server.url, api_key="x", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=MSG, tools=[A_TOOL, SERVER_TOOL])
    assert e.value.body["type"] == "error" and "--hosted-tools" in e.value.body["error"]["message"]
    assert warnings_in(caplog) == [] and turns(reject_server, "responses", 0) == []


@pytest.mark.parametrize("tool, param", [
    ({**SHELL, "type": "functions"}, "tools[1].type"),  # a typo is not a hosted tool
    ({k: v for k, v in SHELL.items() if k != "type"}, "tools[1].type"),
    ({"type": "namespace", "name": "n", "tools": ["shell"]}, "tools[1].tools[0]"),
    ({"type": "namespace", "name": "n", "tools": [{"type": "fuction"}]}, "tools[1].tools[0].type"),
])
def test_a_malformed_tool_is_a_400_naming_it_even_under_drop(drop_server, tool, param):
    with pytest.raises(openai.BadRequestError) as e:
        drop_server.client().responses.create(model="m", input="hi", max_output_tokens=2,
                                              tools=[PLAN, tool])
    assert e.value.body["param"] == param, e.value.body
    assert "--hosted-tools drop" not in e.value.body["message"]


def test_every_hosted_type_of_the_sdk_is_dropped(drop_server):
    """The OpenAI SDK's other tool types (tool_param.py's ToolParam union) and dated versions."""
    hosted = ["web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
              "computer", "computer_use_preview", "mcp", "code_interpreter", "image_generation",
              "local_shell", "shell", "custom", "tool_search", "apply_patch"]
    r = drop_server.client().responses.create(
        model="m", input="hi", max_output_tokens=2,
        tools=[SHELL, *({"type": t} for t in hosted)])
    assert [t.name for t in r.tools] == ["shell"]


@pytest.mark.parametrize("kind", ["web_search", "bash", "web_search_2025"])
def test_an_unknown_anthropic_tool_type_is_a_400_under_drop(drop_server, kind):
    claude = anthropic.Anthropic(base_url=drop_server.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="m", max_tokens=2, messages=MSG,
                               tools=[A_TOOL, {**A_TOOL, "name": "w", "type": kind}])
    assert "tools[1].type" in e.value.body["error"]["message"], e.value.body
    m = claude.messages.create(model="m", max_tokens=2, messages=MSG, tools=[
        A_TOOL, {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}])
    assert m.type == "message"
