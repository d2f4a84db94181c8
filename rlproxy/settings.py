"""All configuration in one typed object, built once in `main` and passed down explicitly.

Sources, lowest to highest priority: defaults, an optional TOML file (sections named like the
classes below: `[server]`, `[model]`, ...), `RLPROXY_<FIELD>` environment variables (flat: field
names are unique across sections, e.g. `RLPROXY_API_KEY`, `RLPROXY_PORT`), command-line flags.
Every check lives here, and each message says what to change.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


from rlproxy.losses import LOSSES  # noqa: E402  (one list of loss names)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerSettings(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    max_request_mb: float = Field(32.0, gt=0)
    served_model_name: list[str] = []  # aliases; the first is the name /v1/models reports
    strict_model_names: bool = False  # off: agents send names of their own, all served
    tinker_max_models: int = Field(
        4, ge=0, description="Tinker training clients (LoRA models) alive at once under "
        "/api/v1; each holds its LoRA weights, gradients and AdamW state (0: Tinker API off)")
    metrics_public: bool = Field(
        False, description="serve GET /metrics without the API key (for a Prometheus that "
        "cannot send one); the dashboard and the actions stay behind it")
    log_format: Literal["text", "json"] = Field(
        "text", description="json: one JSON object per log line, with session id, turn uid and "
        "adapter version where known")
    max_queued_requests: int = Field(
        64, ge=1, description="generation requests in flight or waiting at once; past it a "
        "request gets 429 with Retry-After")
    body_read_timeout_s: float = Field(
        30.0, gt=0, description="a request body not fully received within this many seconds "
        "is a 408")
    max_json_depth: int = Field(
        64, ge=8, le=200, description="deepest nesting of arrays/objects accepted in a JSON "
        "body (tool schemas, tool-call arguments); deeper is a 400")


class ModelSettings(Section):
    model: str | None = None  # a path or hub id; None serves the embedded default
    embedded_size: str = "tiny"
    adapter: str | None = None  # an mlx-lm adapter directory to start from
    lora_rank: int = Field(8, ge=1)
    lora_scale: float = Field(20.0, gt=0)
    lora_layers: int = Field(-1, description="LoRA on the last N blocks; -1 means all")
    lora_keys: list[str] | None = None  # None: every linear layer of each block (mlx-lm's default)
    quantize_bits: Literal[4, 8] | None = Field(
        None, description="QLoRA: quantize the frozen base to 4 or 8 bits (slower on CPU)")

    @field_validator("embedded_size")
    @classmethod
    def _known_size(cls, v: str) -> str:
        from rlproxy.embedded_model import SIZES

        if v not in SIZES:
            raise ValueError(f"embedded_size must be one of {sorted(SIZES)}, not {v!r}")
        return v


class EngineSettings(Section):
    max_batch: int = Field(16, ge=1, description="concurrent sequences decoded together")
    prefill_step_size: int = Field(2048, ge=16)
    default_max_tokens: int = Field(
        1024, ge=1, description="completion cap when a request names none (OpenAI: context)"
    )
    strict_max_tokens: bool = Field(
        False, description="a max_tokens beyond what the context has left is a 400 "
        "(off: the budget is clamped to what is left, and the clamp recorded)")
    reasoning_parser: Literal["auto", "none"] = Field(
        "auto", description="auto: <think> text is returned as reasoning, apart from the "
        "content; none: it stays in the content")


class CacheSettings(Section):
    prefix_cache: bool = True
    prefix_cache_disk_limit_gb: float = Field(4.0, gt=0)
    prefix_cache_memory_mb: float = Field(512.0, ge=0)
    prefix_block_tokens: int = Field(256, ge=16, description="prefix hashes cover whole blocks")
    kv_bits: Literal[4, 8] | None = Field(None, description="quantize stored KV to 4 or 8 bits")
    kv_group_size: int = Field(64, ge=16)
    quantized_kv_start: int = Field(0, ge=0)
    kv_reuse_max_lag: int = Field(
        4, ge=0, le=64, description="reuse prefix KV computed under an adapter up to this many "
        "versions older than the one served (0: only the served adapter's own KV)")


PRM_PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prm_prompts"


class ScoringSettings(Section):
    method: Literal["rl", "opd", "combine"] = "rl"
    judge: bool = True  # False: rewards come only from feedback and reward functions
    prm_m: int = Field(3, ge=1, description="judge votes per turn")
    prm_temperature: float = Field(0.6, ge=0, le=2)
    prm_max_tokens: int = Field(256, ge=8)
    prm_max_context_chars: int = Field(4000, ge=200, description="trim the user request")
    prm_prompts: Path = PRM_PROMPTS_DIR
    w_opd: float = 1.0
    w_rl: float = 1.0
    at_least_one: bool = True
    feedback_mode: Literal["override", "add"] = "override"
    reward_functions: list[str] = []  # "module:function", called with (turn, next_state)
    judge_url: str | None = None  # an OpenAI-compatible /v1 URL; None: the local base model
    judge_model: str = "default"
    judge_api_key: str | None = None
    teacher_url: str | None = None  # needs prompt log-probs (vLLM); None: the local base model
    judge_timeout_s: float = Field(60.0, gt=0)
    judge_retries: int = Field(3, ge=0)
    judge_concurrency: int = Field(4, ge=1)
    judge_yield_ms: float = Field(
        20.0, ge=0, description="local judge: pause per token while live requests decode")
    reward_timeout_s: float = Field(
        10.0, gt=0, description="a reward function still running after this many seconds is "
        "recorded as failed (it runs on a worker thread, never on the event loop)")
    score_all_choices: bool = Field(
        False, description="with n > 1, the judge scores every choice against the same next "
        "state (reward functions always score every choice)")

    @field_validator("reward_functions")
    @classmethod
    def _module_function(cls, v: list[str]) -> list[str]:
        for name in v:
            if name.count(":") != 1 or not all(name.split(":")):
                raise ValueError(f"reward function {name!r} must look like 'module:function'")
        return v


class TrainerSettings(Section):
    train: bool = True  # False (--no-train): serve, record and score, never update the adapter
    loss_fn: Literal[LOSSES] = "ppo"
    eps_low: float = Field(0.2, ge=0, le=1)
    eps_high: float = Field(0.28, ge=0)
    dro_beta: float = Field(0.1, ge=0)
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the base model (0: off)")
    learning_rate: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    batch_size: int = Field(4, ge=1, description="scored turns per optimizer step")
    train_epochs: int = Field(1, ge=1, description="optimizer steps per batch")
    max_context_tokens: int = Field(
        40960, ge=16, description="longer turns are skipped (the memory estimate guards the rest)")
    prompt_grad: Literal["full", "none"] = Field(
        "none", description="none: no gradient through the prompt's keys and values (exact "
        "log-probs, a step costs about one prefill); full: the exact gradient, ~3x slower")
    train_chunk_tokens: int = Field(
        128, ge=16, description="positions per training unit (fewer past 8k tokens of context); "
        "a smaller value yields to serving sooner; a larger one may train faster on big models")
    train_memory_gb: float | None = Field(
        None, gt=0, description="skip turns whose step is estimated to need more memory than "
        "this many GB (default: 3/4 of physical memory less the loaded weights, serving and KL "
        "reference, and a 2 GB serving reserve); raise it to train longer turns")
    grad_clip: float = Field(1.0, ge=0, description="max gradient norm (0: off)")
    baseline: Literal["group", "group-std", "mean", "none"] = Field(
        "mean", description="advantage baseline: group (r - mean of the request's scored "
        "choices), group-std (also divided by their std), mean (running mean of rewards), none; "
        "a group of 2 or more scored choices always uses its group baseline")
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0, description="linear warmup from 0 over this many steps")
    lr_min: float = Field(0.0, ge=0, description="floor of the cosine/linear decay")
    lr_decay_steps: int = Field(
        1000, ge=1, description="steps over which cosine/linear decay to lr_min (after warmup)")
    entropy_coef: float = Field(
        0.0, ge=0, description="entropy bonus over completion tokens (0: off)")
    eval_every: int = Field(
        0, ge=0, description="evaluate the candidate adapter every N steps before publishing "
        "it; a worse one is rolled back (0: off)")
    eval_prompts: Path | None = Field(
        None, description="extra probe prompts for the eval gate: JSONL of {messages, tools?}")
    eval_reward_functions: list[str] = Field(
        [], description="module:function rewards the eval gate scores probes with, held back "
        "from training (default: the scoring reward functions)")
    eval_probes: int = Field(8, ge=1, description="probe prompts per evaluation")
    eval_max_tokens: int = Field(32, ge=1, description="tokens sampled per probe")
    eval_tolerance: float = Field(
        0.1, ge=0, description="publish only if the probe reward is at most this much below "
        "the served adapter's")
    max_kl: float | None = Field(
        None, gt=0, description="publish only if KL to the base and to the served adapter "
        "stays under this (unset: no bound)")
    rollback_lr_factor: float = Field(
        0.5, gt=0, le=1, description="multiply the learning rate by this at each rollback")
    max_rollbacks: int = Field(
        3, ge=1, description="rollbacks in a row that pause training")
    save_interval: int = Field(10, ge=1)
    keep_checkpoints: int = Field(3, ge=1)
    resume: bool = True
    duty_cycle: float = Field(
        0.5, gt=0, le=1, description="share of time training may take while requests decode")
    max_step_attempts: int = Field(
        2, ge=1, le=10, description="steps a turn may fail (raise, or die in) before it is "
        "quarantined (1 to 10);"
        " 2 retries it once, 1 quarantines every turn of a failed step")


class RecordSettings(Section):
    data_dir: Path = Path.home() / ".rlproxy"
    fsync: bool = True  # fsync every record line: an acknowledged turn survives power loss too
    responses_store_mb: float = Field(
        256.0, gt=0, description="disk kept for stored Responses (previous_response_id, "
        "GET /v1/responses/{id}); the oldest go first")


class SessionSettings(Section):
    session_idle_timeout_s: float = Field(
        1800.0, gt=0, description="close a session after this long without a request")
    max_open_sessions: int = Field(
        4096, ge=1, description="open sessions kept at once; past it the longest idle is closed")
    train_sessions_matching: str | None = Field(
        None, description="train only sessions whose id matches this regex (X-RL-Train: 1|0 "
        "decides per request and wins)")

    @field_validator("train_sessions_matching")
    @classmethod
    def _regex(cls, v):
        if v is not None:
            import re

            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"train_sessions_matching is not a valid regex: {e}") from None
        return v


class Settings(Section):
    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    cache: CacheSettings = CacheSettings()
    scoring: ScoringSettings = ScoringSettings()
    trainer: TrainerSettings = TrainerSettings()
    records: RecordSettings = RecordSettings()
    sessions: SessionSettings = SessionSettings()


SECTIONS = {name: field.annotation for name, field in Settings.model_fields.items()}


def field_section(name: str) -> str:
    """The section that owns a (flat) field name, e.g. 'api_key' -> 'server'."""
    for section, cls in SECTIONS.items():
        if name in cls.model_fields:
            return section
    raise KeyError(name)


def _env_values(environ: dict[str, str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for section, cls in SECTIONS.items():
        for name, field in cls.model_fields.items():
            raw = environ.get(f"RLPROXY_{name.upper()}")
            if raw is None:
                continue
            value: Any = raw
            if "list" in str(field.annotation):
                value = [part.strip() for part in raw.split(",") if part.strip()]
            out.setdefault(section, {})[name] = value
    return out


def load_settings(
    flags: dict[str, Any] | None = None,
    config_file: str | Path | None = None,
    environ: dict[str, str] | None = None,
) -> Settings:
    """Merge the sources into one validated Settings; raise ValueError saying what to fix."""
    merged: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    if config_file:
        path = Path(config_file)
        try:
            toml = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist; fix --config") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
        for section, values in toml.items():
            if section not in SECTIONS or not isinstance(values, dict):
                raise ValueError(
                    f"config file {path}: unknown section [{section}]; "
                    f"sections are {', '.join(SECTIONS)}"
                )
            merged[section].update(values)
    env = os.environ if environ is None else environ
    for section, values in _env_values(dict(env)).items():
        merged[section].update(values)
    for name, value in (flags or {}).items():
        if value is not None:
            merged[field_section(name)][name] = value
    try:
        return Settings(**merged)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise ValueError(f"invalid settings: {problems}") from None
