"""`rlproxy connect AGENT`: each agent's config is merged into its own file in a temporary HOME
(the user's settings and comments survive), backed up once, restored byte for byte by --undo;
--dry-run writes nothing; the model name and window come from the real server's /v1/models.

The agents themselves are not installed here: `--check` runs a stand-in `codex` script that
sends one request the way its config says (the real agents were run by hand: docs/agents.md)."""

from __future__ import annotations

import difflib
import json
import os
import sys
import tomllib

import openai
import pytest
import requests
from ruamel.yaml import YAML

from conftest import ServerThread, make_settings, server_with
from rlproxy.cli import main
from rlproxy.connect import check
from rlproxy.connect.agents import AGENTS, Target

TINY = "rlproxy-embedded-tiny"

SEEDS = {
    "codex": (".codex/config.toml", """\
# my Codex setup
model = "gpt-5.2-codex"  # the usual one
approval_policy = "on-request"

[projects."/home/me/src/app"]
trust_level = "trusted"

[mcp_servers.docs]
command = "npx"
args = ["-y", "docs-mcp"]

[model_providers.azure]
name = "Azure"  # work account
base_url = "https://example.openai.azure.com/openai"
"""),
    "claude": (".claude/settings.json", """\
{
    "permissions": {
        "allow": ["Bash(npm run test:*)", "Read(~/.zshrc)"]
    },
    "env": {
        "DISABLE_AUTOUPDATER": "1",
        "ANTHROPIC_API_KEY": "sk-ant-old"
    },
    "includeCoAuthoredBy": false
}
"""),
    "opencode": (".config/opencode/opencode.json", """\
{
  "$schema": "https://opencode.ai/config.json",
  "theme": "tokyonight",
  "provider": {
    "ollama": {
      "npm": "@ai-sdk/openai-compatible",
      "options": {"baseURL": "http://localhost:11434/v1"},
      "models": {"qwen3:8b": {}}
    }
  },
  "mcp": {"docs": {"type": "local", "command": ["npx", "docs-mcp"]}}
}
"""),
    "openclaw": (".openclaw/openclaw.json", """\
{
  "gateway": {"port": 18789, "mode": "local"},
  "models": {
    "providers": {
      "rlproxy": {"baseUrl": "http://old:1/v1", "models": [{"id": "older-model"}]},
      "lmstudio": {"baseUrl": "http://127.0.0.1:1234/v1", "api": "openai-responses"}
    }
  },
  "agents": {"defaults": {"model": "anthropic/claude-opus-4-6", "workspace": "~/work"}}
}
"""),
    "hermes": (".hermes/config.yaml", """\
# Hermes Agent configuration
model:
  default: anthropic/claude-opus-4.6   # my daily driver
  provider: openrouter
toolsets:
  - hermes-cli
agent:
  max_turns: 60  # keep runs short
terminal:
  backend: local
"""),
}
ENV_VARS = ("CODEX_HOME", "CLAUDE_CONFIG_DIR", "XDG_CONFIG_HOME", "OPENCODE_CONFIG",
            "OPENCLAW_CONFIG_PATH", "OPENCLAW_STATE_DIR", "HERMES_HOME")


@pytest.fixture
def home(tmp_path, monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def parse(agent: str, text: str) -> dict:
    if agent == "codex":
        return tomllib.loads(text)
    if agent == "hermes":
        return YAML(typ="safe").load(text)
    return json.loads(text)


def rlproxy_settings(agent: str, doc: dict) -> tuple[str, str, int | None]:
    """(the base URL, the model, the window) that connect wrote, read back per agent."""
    if agent == "codex":
        p = doc["model_providers"]["rlproxy"]
        assert doc["model_provider"] == "rlproxy" and p["wire_api"] == "responses"
        return p["base_url"], doc["model"], doc.get("model_context_window")
    if agent == "claude":
        env = doc["env"]
        assert env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == env["ANTHROPIC_MODEL"]
        return env["ANTHROPIC_BASE_URL"] + "/v1", env["ANTHROPIC_MODEL"], None
    if agent == "opencode":
        p = doc["provider"]["rlproxy"]
        assert p["npm"] == "@ai-sdk/openai-compatible"
        (name, model), = p["models"].items()
        assert doc["model"] == doc["small_model"] == f"rlproxy/{name}"
        return p["options"]["baseURL"], name, model.get("limit", {}).get("context")
    if agent == "openclaw":
        p = doc["models"]["providers"]["rlproxy"]
        assert p["api"] == "openai-completions"
        model = p["models"][0]
        assert doc["agents"]["defaults"]["model"]["primary"] == f"rlproxy/{model['id']}"
        return p["baseUrl"], model["id"], model.get("contextWindow")
    m = doc["model"]
    assert m["provider"] == "custom" and "context_length" not in m
    return m["base_url"], m["default"], None


def user_settings_survive(agent: str, doc: dict, text: str) -> None:
    if agent == "codex":
        assert doc["projects"]["/home/me/src/app"]["trust_level"] == "trusted"
        assert doc["mcp_servers"]["docs"]["args"] == ["-y", "docs-mcp"]
        assert doc["model_providers"]["azure"]["name"] == "Azure"
        assert "# my Codex setup" in text and "# work account" in text
    elif agent == "claude":
        assert doc["permissions"]["allow"][0] == "Bash(npm run test:*)"
        assert doc["env"]["DISABLE_AUTOUPDATER"] == "1" and doc["includeCoAuthoredBy"] is False
        assert doc["env"]["ANTHROPIC_API_KEY"] == "rlproxy"  # not a stale key beside ours
        assert text.startswith('{\n    "permissions"')  # the file's own indent
    elif agent == "opencode":
        assert doc["theme"] == "tokyonight" and doc["mcp"]["docs"]["type"] == "local"
        assert doc["provider"]["ollama"]["models"] == {"qwen3:8b": {}}
    elif agent == "openclaw":
        assert doc["gateway"] == {"port": 18789, "mode": "local"}
        assert doc["models"]["providers"]["lmstudio"]["api"] == "openai-responses"
        assert [m["id"] for m in doc["models"]["providers"]["rlproxy"]["models"]] == [
            TINY, "older-model"]
        assert doc["agents"]["defaults"]["workspace"] == "~/work"
    else:
        assert doc["toolsets"] == ["hermes-cli"] and doc["agent"]["max_turns"] == 60
        assert "# Hermes Agent configuration" in text and "# keep runs short" in text


def listing(root):
    return sorted((str(p.relative_to(root)), p.read_bytes()) for p in root.rglob("*")
                  if p.is_file())


@pytest.mark.parametrize("agent", sorted(SEEDS))
def test_connect_merges_backs_up_once_and_undo_restores_byte_for_byte(agent, home, server,
                                                                      capsys):
    rel, seed = SEEDS[agent]
    path = home / rel
    path.parent.mkdir(parents=True)
    path.write_text(seed)
    path.chmod(0o640)
    assert main(["connect", agent, "--url", server.url]) == 0
    text = path.read_text()
    doc = parse(agent, text)
    url, model, window = rlproxy_settings(agent, doc)
    assert (url, model) == (server.base_url, TINY)
    if agent in ("codex", "opencode", "openclaw"):
        assert window == server.loaded.context_length
    user_settings_survive(agent, doc, text)
    backup = path.with_name(path.name + ".rlproxy-backup")
    assert backup.read_text() == seed and (path.stat().st_mode & 0o777) == 0o640
    out = capsys.readouterr().out
    assert f"+++ {path}" in out and "run it: " in out

    before = listing(home)
    assert main(["connect", agent, "--url", server.url]) == 0  # idempotent, first backup kept
    assert listing(home) == before
    assert "already connected" in capsys.readouterr().out
    assert main(["connect", agent, "--url", server.url, "--model", "other"]) == 0
    assert parse(agent, path.read_text()) != doc and backup.read_text() == seed  # the first

    assert main(["connect", agent, "--undo"]) == 0
    assert path.read_bytes() == seed.encode() and not backup.exists()
    assert (path.stat().st_mode & 0o777) == 0o640
    assert main(["connect", agent, "--undo"]) == 1  # nothing left to undo


@pytest.mark.parametrize("agent", sorted(SEEDS))
def test_a_file_connect_created_is_removed_by_undo(agent, home, server):
    path = home / SEEDS[agent][0]
    assert main(["connect", agent, "--url", server.url + "/v1/"]) == 0
    url, model, _ = rlproxy_settings(agent, parse(agent, path.read_text()))
    assert (url, model) == (server.base_url, TINY)
    assert (path.stat().st_mode & 0o777) == 0o600  # it holds the API key
    assert main(["connect", agent, "--undo"]) == 0
    assert listing(home) == []


@pytest.mark.parametrize("agent", sorted(SEEDS))
@pytest.mark.parametrize("seeded", [True, False])
def test_dry_run_prints_the_diff_and_writes_nothing(agent, seeded, home, server, capsys):
    rel, seed = SEEDS[agent]
    if seeded:
        (home / rel).parent.mkdir(parents=True)
        (home / rel).write_text(seed)
    before = listing(home) if home.exists() else []
    assert main(["connect", agent, "--url", server.url, "--dry-run"]) == 0
    assert (listing(home) if home.exists() else []) == before
    out = capsys.readouterr().out
    assert f"+++ {home / rel}" in out and "nothing written" in out
    assert ("--- /dev/null" in out) is not seeded


@pytest.mark.parametrize("agent,var,rel", [
    ("codex", "CODEX_HOME", "config.toml"), ("hermes", "HERMES_HOME", "config.yaml"),
    ("claude", "CLAUDE_CONFIG_DIR", "settings.json"),
    ("opencode", "XDG_CONFIG_HOME", "opencode/opencode.json"),
    ("openclaw", "OPENCLAW_STATE_DIR", "openclaw.json")])
def test_the_agents_own_location_variables_are_followed(agent, var, rel, home, tmp_path,
                                                        monkeypatch, server):
    monkeypatch.setenv(var, str(tmp_path / "elsewhere"))
    assert main(["connect", agent, "--url", server.url]) == 0
    parse(agent, (tmp_path / "elsewhere" / rel).read_text())
    assert not home.exists()


def test_model_name_and_window_come_from_v1_models(home, server, capsys):
    card = requests.get(server.base_url + "/models").json()["data"][0]
    assert main(["connect", "codex", "--url", server.url]) == 0
    doc = tomllib.loads((home / ".codex/config.toml").read_text())
    assert (doc["model"], doc["model_context_window"]) == (card["id"], card["context_length"])
    assert main(["connect", "codex", "--url", server.url, "--model", "mine"]) == 0
    doc = tomllib.loads((home / ".codex/config.toml").read_text())
    assert (doc["model"], doc["model_context_window"]) == ("mine", card["context_length"])


@pytest.mark.parametrize("agent", sorted(SEEDS))
def test_adapter_points_the_agent_at_its_personal_adapter(agent, home, server, capsys):
    card = requests.get(server.base_url + "/models").json()["data"][0]
    assert main(["connect", agent, "--url", server.url, "--adapter", "Alice"]) == 0
    text = (home / SEEDS[agent][0]).read_text()
    base, model, window = rlproxy_settings(agent, parse(agent, text))
    assert model == f"{card['id']}:alice"
    assert window in (None, card["context_length"])
    # the name the agent will send: served, recorded and trained as alice's
    r = openai.OpenAI(base_url=base if agent != "claude" else server.base_url,
                      api_key="x", max_retries=0).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.headers["X-RL-Adapter"] == "alice"
    assert requests.get(f"{server.base_url}/models/{model}").json()["id"] == model
    assert main(["connect", agent, "--url", server.url, "--adapter", "no/slash"]) == 2


def test_without_a_server_it_says_so_and_leaves_the_window_out(home, capsys):
    assert main(["connect", "opencode", "--url", "http://127.0.0.1:9"]) == 0
    doc = json.loads((home / ".config/opencode/opencode.json").read_text())
    assert "limit" not in doc["provider"]["rlproxy"]["models"]["smollm2-135m-instruct"]
    out = capsys.readouterr().out
    assert "no server answered" in out
    assert "OpenCode needs a window of 13,000 tokens" in out and "warning" not in out


# The flag each agent's warning names, by served window; None: its prompts fit, no warning.
# Measured needs (agents.py): Codex ~9k, OpenCode 13k, OpenClaw 25k, Claude Code 36k, Hermes 64k.
WINDOW_FIXES = {
    8192: {"codex": "--context-length 16384", "opencode": "--context-length 16384",
           "openclaw": "--context-length 32768", "claude": "--context-length 65536",
           "hermes": "--context-length 65536"},
    16384: {"codex": None, "opencode": None, "openclaw": "--context-length 32768",
            "claude": "--context-length 65536", "hermes": "--context-length 65536"},
    131072: dict.fromkeys(SEEDS),  # the tiny model's own window
}


window_8k = server_with(None, context_length=8192)  # None: the app loads the tiny model itself
window_16k = server_with(None, context_length=16384)


@pytest.fixture(scope="module")
def windows(server, window_8k, window_16k):
    """Servers of the tiny model whose windows were lowered with --context-length (8,192 is
    SmolLM2's, the default model's), and the shared one at its own 131,072."""
    return {8192: window_8k, 16384: window_16k, 131072: server}


@pytest.mark.parametrize("window,agent", [(w, a) for w in WINDOW_FIXES for a in sorted(SEEDS)])
def test_every_agent_is_warned_when_its_prompts_do_not_fit_the_window(window, agent, home,
                                                                      windows, capsys):
    srv = windows[window]
    assert requests.get(srv.base_url + "/models").json()["data"][0]["context_length"] == window
    assert main(["connect", agent, "--url", srv.url]) == 0
    out = capsys.readouterr().out
    fix = WINDOW_FIXES[window][agent]
    if fix is None:
        assert "warning" not in out and f"the server's window is {window:,} tokens;" in out
    else:
        assert f"warning: the server's window is {window:,} tokens and {AGENTS[agent].name}" \
            in out
        assert f"`rlproxy serve {fix}`" in out and "`rlproxy serve --model tiny`" in out


def test_a_file_it_cannot_merge_is_left_alone(home, server, capsys):
    path = home / ".config/opencode/opencode.json"
    path.parent.mkdir(parents=True)
    path.write_text('{\n  // my theme\n  "theme": "nord",\n}\n')
    before = listing(home)
    assert main(["connect", "opencode", "--url", server.url]) == 1
    assert listing(home) == before
    assert "not plain JSON" in capsys.readouterr().err


def test_check_runs_one_turn_and_says_where_it_landed(home, tmp_path, monkeypatch, server,
                                                      capsys):
    """A stand-in `codex` that sends one Responses request as its config.toml says."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    agent = bin_dir / "codex"
    agent.write_text(f"""#!{sys.executable}
import json, os, tomllib, urllib.request
cfg = tomllib.load(open(os.path.expanduser("~/.codex/config.toml"), "rb"))
p = cfg["model_providers"][cfg["model_provider"]]
body = {{"model": cfg["model"], "input": "Say hi.", "max_output_tokens": 4}}
req = urllib.request.Request(p["base_url"] + "/responses", json.dumps(body).encode(),
    {{"Authorization": "Bearer " + p["experimental_bearer_token"],
      "Content-Type": "application/json"}})
print(json.load(urllib.request.urlopen(req))["status"])
""")
    agent.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert main(["connect", "codex", "--url", server.url, "--check"]) == 0
    out = capsys.readouterr().out
    assert "codex exited 0" in out and "api responses" in out and "landed: session " in out
    sid = out.split("landed: session ")[1].split(",")[0]
    turns = requests.get(f"{server.base_url}/sessions/{sid}").json()["turn_list"]
    assert turns[-1]["api"] == "responses"


def test_check_says_when_the_agent_is_not_installed(home, monkeypatch, server, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["connect", "hermes", "--url", server.url, "--check"]) == 1
    assert "not installed (install: pip install hermes-agent)" in capsys.readouterr().err


def test_a_server_that_wants_a_key_is_said_and_nothing_is_written(home, tmp_path, monkeypatch,
                                                                  capsys):
    with ServerThread(make_settings(tmp_path / "keyed", api_key="sekrit")) as keyed:
        assert main(["connect", "codex", "--url", keyed.url]) == 1
        err = capsys.readouterr().err
        assert "answered 401" in err and "--api-key" in err and "nothing written" in err
        assert not home.exists() or listing(home) == []
        assert main(["connect", "codex", "--url", keyed.url, "--api-key", "sekrit"]) == 0
        doc = tomllib.loads((home / ".codex/config.toml").read_text())
        assert doc["model_providers"]["rlproxy"]["experimental_bearer_token"] == "sekrit"
        # --check asks the server too: a wrong key there is said as such, not "not answering"
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "codex").write_text("#!/bin/sh\n")
        (bin_dir / "codex").chmod(0o755)
        monkeypatch.setenv("PATH", str(bin_dir))
        wrong = Target(keyed.url, "m", "wrong", None)
        assert check.check(AGENTS["codex"], wrong) == 1
        err = capsys.readouterr().err
        assert "answered 401" in err and "--api-key" in err


def test_dry_run_says_the_check_is_skipped(home, server, capsys):
    assert main(["connect", "codex", "--url", server.url, "--dry-run", "--check"]) == 0
    out = capsys.readouterr().out
    assert "--check skipped" in out and "nothing written" in out
    assert not (home / ".codex/config.toml").exists()


def test_an_agent_that_times_out_is_reported_with_its_output(home, tmp_path, monkeypatch,
                                                             server, capsys):
    """subprocess hands a timed-out child's output over as bytes, even with text=True."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "codex").write_text(f"#!{sys.executable}\nimport sys, time\n"
                                   "sys.stdout.buffer.write(b'thinking \\xff...\\n')\n"
                                   "sys.stdout.flush()\ntime.sleep(60)\n")
    (bin_dir / "codex").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(check, "TIMEOUT_S", 2)
    assert main(["connect", "codex", "--url", server.url, "--check"]) == 1
    out = capsys.readouterr().out
    assert "codex exited timed out; its last lines:\nthinking \ufffd..." in out


# PyYAML's default (list dashes at their key's column) and a 4-space file
HERMES_STYLES = ["""\
model:
  default: anthropic/claude-opus-4.6   # mine
  provider: openrouter
toolsets:
- hermes-cli
- web
agent:
  max_turns: 60
  disabled:
  - a: 1
    b: [x, y]
""", """\
model:
    default: anthropic/claude-opus-4.6
    provider: openrouter
toolsets:
    - hermes-cli
    - web
agent:
    max_turns: 60
"""]


@pytest.mark.parametrize("text", HERMES_STYLES)
def test_yaml_lines_connect_does_not_touch_keep_their_bytes(text, home, server):
    path = home / ".hermes/config.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    assert main(["connect", "hermes", "--url", server.url]) == 0
    new = path.read_text()
    removed = [ln[2:] for ln in difflib.ndiff(text.splitlines(), new.splitlines())
               if ln.startswith("- ")]
    assert removed == [ln for ln in text.splitlines()[1:3]], removed  # model's two lines only
    # past `model`, only the stale-stream line is added to the user's own `agent` section
    rest = new.split("toolsets:")[1].splitlines(keepends=True)
    added = [ln for ln in rest if "local_stream_stale_timeout" in ln]
    assert len(added) == 1 and added[0].strip() == "local_stream_stale_timeout: 3600"
    assert "".join(ln for ln in rest if ln not in added) == text.split("toolsets:")[1]


# ---- the completion budget (issue 41): an eighth of the window, at most 8,192, within a cap ----

def written_budget(agent: str, doc: dict):
    """The completion budget connect wrote into the agent's own config, read back per agent."""
    if agent == "claude":
        return int(doc["env"]["CLAUDE_CODE_MAX_OUTPUT_TOKENS"])
    if agent == "opencode":
        (model,) = doc["provider"]["rlproxy"]["models"].values()
        return model["limit"]["output"]
    if agent == "openclaw":
        return doc["models"]["providers"]["rlproxy"]["models"][0]["maxTokens"]
    if agent == "hermes":
        return doc["model"]["max_tokens"]
    assert not any("output" in k for k in doc), doc  # Codex has no setting for one
    return None


capped = server_with(None, max_completion_tokens=512)


@pytest.mark.parametrize("window,budget", [(131072, 8192), (8192, 1024), (16384, 2048)])
@pytest.mark.parametrize("agent", sorted(SEEDS))
def test_connect_writes_a_completion_budget_sized_to_the_window(agent, window, budget, home,
                                                                windows, capsys):
    """Hermes' custom provider asks for 65,536 completion tokens unless model.max_tokens says
    otherwise: on a CPU a first turn then ran for 17 minutes and did not finish."""
    assert main(["connect", agent, "--url", windows[window].url]) == 0
    doc = parse(agent, (home / SEEDS[agent][0]).read_text())
    out = capsys.readouterr().out
    if agent == "codex":
        assert written_budget(agent, doc) is None
        assert "note: Codex CLI has no completion-budget setting" in out
        return
    assert written_budget(agent, doc) == budget
    assert f"completion budget: {budget:,} tokens" in out
    # Hermes doubles the budget of a cut reply's retries: said, with the flag that caps them
    assert ("--max-completion-tokens N` caps those retries" in out) is (agent == "hermes")


def test_connect_hermes_keeps_within_the_servers_max_completion_tokens(home, capped, capsys):
    card = requests.get(capped.base_url + "/models").json()["data"][0]
    assert card["max_completion_tokens"] == 512
    assert main(["connect", "hermes", "--url", capped.url]) == 0
    doc = YAML(typ="safe").load((home / ".hermes/config.yaml").read_text())
    model = doc["model"]
    assert model["max_tokens"] == 512 and model["provider"] == "custom"
    # a cold agent-length prefill on a CPU outlasts Hermes' 900-s stale-stream guard (it then
    # sends the request again): connect gives it an hour
    assert doc["agent"]["local_stream_stale_timeout"] == 3600
    out = capsys.readouterr().out
    assert "completion budget: 512 tokens" in out and "caps those retries" not in out
