"""What `rlproxy connect` writes for each agent, and where: one merge function per agent that sets
only rlproxy's keys in the agent's own config document, plus where the agent reads that file,
the command that runs it, the one-turn command `--check` runs and the window it needs.

Checked against the agents themselves (docs/agents.md has the versions): Codex CLI reads
$CODEX_HOME/config.toml, Claude Code the `env` block of ~/.claude/settings.json, OpenCode
~/.config/opencode/opencode.json, OpenClaw ~/.openclaw/openclaw.json, Hermes Agent
$HERMES_HOME/config.yaml. Knows nothing of files on disk, diffs or backups (command.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rlproxy.connect.formats import table

PROVIDER = "rlproxy"  # the provider id connect adds to agents that name providers
MAX_BUDGET = 8192  # completion tokens: a long file written in one tool call fits
CHECK_PROMPT = "Say hi in one word."


@dataclass(frozen=True)
class Target:
    """The server an agent is pointed at."""

    url: str  # the server's root, without /v1 (Anthropic clients add /v1 themselves)
    model: str
    api_key: str
    context: int | None  # the served window; None when the server did not say
    cap: int | None = None  # the server's --max-completion-tokens, when it has one

    @property
    def openai_url(self) -> str:
        return self.url + "/v1"

    @property
    def budget(self) -> int | None:
        """The completion budget an agent is given: an eighth of the window, at most 8,192
        tokens, and never past the server's own cap. Agents otherwise ask for budgets of the
        models they know (Hermes 65,536, Claude Code 32,000): on a CPU a reply that never stops
        then runs for most of an hour. None when the window is unknown."""
        if not self.context:
            return None
        budget = min(MAX_BUDGET, self.context // 8)
        return min(budget, self.cap) if self.cap else budget


def home() -> Path:
    return Path(os.environ.get("HOME") or Path.home())


def env_dir(name: str, default: Path) -> Path:
    return Path(os.environ[name]) if os.environ.get(name) else default


def codex(doc, t: Target) -> None:
    """A provider on the Responses API (the only one Codex speaks to custom providers), made the
    default; the key goes as the provider's bearer token, so no environment variable is needed."""
    doc["model_provider"] = PROVIDER
    doc["model"] = t.model
    if t.context:
        doc["model_context_window"] = t.context  # Codex compacts before it overflows the window
    provider = table(table(doc, "model_providers", "toml"), PROVIDER, "toml", header=True)
    provider["name"] = PROVIDER
    provider["base_url"] = t.openai_url
    provider["wire_api"] = "responses"
    provider["experimental_bearer_token"] = t.api_key


def claude(doc, t: Target) -> None:
    """Claude Code's settings `env` block: the Messages API at the server's root, every model
    alias mapped to the served name (background calls use the haiku alias)."""
    env = table(doc, "env", "json")
    env["ANTHROPIC_BASE_URL"] = t.url
    env["ANTHROPIC_AUTH_TOKEN"] = t.api_key  # a Bearer token: no "use this API key?" prompt
    if "ANTHROPIC_API_KEY" in env:  # a second, stale key would be sent beside ours
        env["ANTHROPIC_API_KEY"] = t.api_key
    env["ANTHROPIC_MODEL"] = t.model
    for alias in ("HAIKU", "SONNET", "OPUS"):
        env[f"ANTHROPIC_DEFAULT_{alias}_MODEL"] = t.model
    env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"  # no telemetry or update checks
    if t.budget:  # its main turns' max_tokens (32,000 otherwise)
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(t.budget)


def opencode(doc, t: Target) -> None:
    """A custom provider on @ai-sdk/openai-compatible (Chat Completions), made the default and the
    small model (OpenCode's title calls), so no request leaves for another provider."""
    if not doc:
        doc["$schema"] = "https://opencode.ai/config.json"
    provider = table(table(doc, "provider", "json"), PROVIDER, "json")
    provider["npm"] = "@ai-sdk/openai-compatible"
    provider["name"] = PROVIDER
    options = table(provider, "options", "json")
    options["baseURL"] = t.openai_url
    options["apiKey"] = t.api_key
    model = table(table(provider, "models", "json"), t.model, "json")
    model["name"] = t.model
    if t.context:  # OpenCode compacts at context - output, and asks for `output` tokens
        model["limit"] = {"context": t.context, "output": t.budget}
    doc["model"] = doc["small_model"] = f"{PROVIDER}/{t.model}"


def openclaw(doc, t: Target) -> None:
    """A provider under models.providers on openai-completions, with the model's window, made the
    default agent model (agents.defaults.model.primary)."""
    providers = table(table(doc, "models", "json"), "providers", "json")
    provider = table(providers, PROVIDER, "json")
    provider["baseUrl"] = t.openai_url
    provider["apiKey"] = t.api_key
    provider["api"] = "openai-completions"
    provider["timeoutSeconds"] = 900  # a CPU prefills an agent's first 20k-token prompt slowly
    entry = {"id": t.model, "name": t.model, "reasoning": False, "input": ["text"],
             "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}
    if t.context:
        entry |= {"contextWindow": t.context, "maxTokens": t.budget}  # its max_tokens
    others = [m for m in provider.get("models") or [] if m.get("id") != t.model]
    provider["models"] = [entry, *others]
    defaults = table(table(doc, "agents", "json"), "defaults", "json")
    if not isinstance(defaults.get("model"), dict):  # a bare "provider/model" string
        defaults["model"] = {}
    defaults["model"]["primary"] = f"{PROVIDER}/{t.model}"


def hermes(doc, t: Target) -> None:
    """The `model` section as a custom OpenAI-compatible endpoint. No context_length: Hermes reads
    the window from /v1/models, so the served window is the one it checks. `max_tokens`: its
    custom provider asks for 65,536 completion tokens otherwise."""
    if not isinstance(doc.get("model"), dict):  # Hermes' default config has `model: ""`
        doc["model"] = None
    model = table(doc, "model", "yaml")
    model["provider"] = "custom"
    model["default"] = t.model
    model["base_url"] = t.openai_url
    model["api_key"] = t.api_key
    if t.budget:
        model["max_tokens"] = t.budget
    # Hermes gives up on a local stream silent for 900 s and sends the request again; a CPU
    # prefills its first ~15k-token prompt in longer than that (26 minutes for SmolLM2 on 2 busy
    # cores, docs/agents.md). A larger value the user set stays.
    agent = table(doc, "agent", "yaml")
    if not (isinstance(agent.get(HERMES_STALE_KEY), (int, float))
            and agent[HERMES_STALE_KEY] >= HERMES_STALE_S):
        agent[HERMES_STALE_KEY] = HERMES_STALE_S


# hermes-agent 0.19 agent/chat_completion_helpers.py: `agent.local_stream_stale_timeout`
HERMES_STALE_KEY, HERMES_STALE_S = "local_stream_stale_timeout", 3600


@dataclass(frozen=True)
class Agent:
    name: str  # what the user calls it
    binary: str
    install: str  # how to get the binary
    fmt: str  # toml | json | yaml
    path: Callable[[], Path]  # where the agent reads its config, from the environment
    merge: Callable  # (doc, Target) -> None
    run: str  # the command that starts it afterwards
    check: list[str]  # one non-interactive turn


AGENTS = {
    "codex": Agent("Codex CLI", "codex", "npm install -g @openai/codex", "toml",
                   lambda: env_dir("CODEX_HOME", home() / ".codex") / "config.toml",
                   codex, "codex",
                   ["codex", "exec", "--skip-git-repo-check", CHECK_PROMPT]),
    "claude": Agent("Claude Code", "claude", "npm install -g @anthropic-ai/claude-code", "json",
                    lambda: env_dir("CLAUDE_CONFIG_DIR", home() / ".claude") / "settings.json",
                    claude, "claude", ["claude", "-p", CHECK_PROMPT]),
    "opencode": Agent("OpenCode", "opencode", "npm install -g opencode-ai", "json",
                      lambda: Path(os.environ.get("OPENCODE_CONFIG") or env_dir(
                          "XDG_CONFIG_HOME", home() / ".config") / "opencode" / "opencode.json"),
                      opencode, "opencode", ["opencode", "run", CHECK_PROMPT]),
    "openclaw": Agent("OpenClaw", "openclaw",
                      "npm install -g openclaw  (needs Node 24.16+ or 26.1+)", "json",
                      lambda: Path(os.environ.get("OPENCLAW_CONFIG_PATH") or env_dir(
                          "OPENCLAW_STATE_DIR", home() / ".openclaw") / "openclaw.json"),
                      openclaw, 'openclaw agent --local --agent main --message "hello"',
                      ["openclaw", "agent", "--local", "--agent", "main", "--message",
                       CHECK_PROMPT]),
    "hermes": Agent("Hermes Agent", "hermes", "pip install hermes-agent", "yaml",
                    lambda: env_dir("HERMES_HOME", home() / ".hermes") / "config.yaml",
                    hermes, "hermes", ["hermes", "chat", "-Q", "-q", CHECK_PROMPT]),
}

# The window each agent needs, in tokens, and why: the prompt of its first turn, measured with the
# agent (a tokenizer with a smaller vocabulary counts more: the tiny model's counted Codex's
# first prompt as 16,475, docs/agents.md), or the least window it accepts.
WINDOW_NEEDS = {
    "codex": (9_000, "its first prompt is that long"),
    "claude": (36_000, "its first prompt is that long: 24 tool schemas and its system prompt"),
    "opencode": (13_000, "its first prompt is that long"),
    "openclaw": (25_000, "its first prompt is that long"),
    # hermes-agent's agent/model_metadata.py MINIMUM_CONTEXT_LENGTH
    "hermes": (64_000, "it refuses a model with a smaller window"),
}

# Where an agent does not keep to the budget connect writes, and what caps it instead.
BUDGET_CAVEATS = {
    # codex-rs's ResponsesApiRequest has no max_output_tokens, nor its config a setting for one
    "codex": "Codex CLI has no completion-budget setting and sends none: the server's "
             "--default-max-tokens (or --max-completion-tokens, when lower) caps its replies",
    # hermes-agent 0.19 agent/conversation_loop.py: `restart_with_length_continuation`
    "hermes": "Hermes Agent retries a reply cut at its budget up to 4 times with the budget "
              "doubled each time (to 32,768 tokens): `rlproxy serve --max-completion-tokens N` "
              "caps those retries too",
}
