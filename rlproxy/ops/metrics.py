"""Prometheus metrics: `GET /metrics`, and the observation points the loop calls.

Two kinds of metric. Counters and gauges that a component keeps (its typed `stats` and its
`health()`: the engine, the prefix cache, the session store, the scorer, the trainer, the
admission gate) are read from it at scrape time by `LiveCollector`, so those components need no
hooks. What only a moment knows (a request's time to first token, a judge call's latency, a
step's loss, a swap's pause) is observed by the one-line `observe_*` calls below, made from
api/turns.py, scoring/scorer.py, training/loop.py and serving/engine.py, and every answer is
counted by api/edge.py's `metrics_middleware` (`REQUESTS`). Those are process-wide objects (one
server per process); each app's registry exposes them beside its own live collector.

A leaf: imports no rlproxy module at run time but appkeys.py (by whose keys it reads the app's
objects, the Tinker API's too; it imports none of them), ops/logs.py (the served adapter version
its JSON lines carry), records.py (the failed writes per file, process-wide) and paths.py (the
record files' sizes), none of which imports a component, so any component may call into it.
Owns no state of the loop, and nothing here touches MLX.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from rlproxy import paths, records
from rlproxy.appkeys import (
    ADAPTERS, ADMISSION, ENGINE, METRICS, MODEL, SCORER, SESSIONS, SETTINGS, TINKER, TRAINER,
)
from rlproxy.ops import logs

recent_ttft: deque[tuple[float, float]] = deque(maxlen=4096)  # (when, seconds): the dashboard

LATENCY_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 20, 40, 80, 160)
PER_TOKEN_BUCKETS = (.001, .0025, .005, .01, .02, .04, .08, .16, .32, .64, 1.28)
REWARD_BUCKETS = (-1, -.75, -.5, -.25, 0, .25, .5, .75, 1)

REQUESTS = Counter("rlproxy_requests", "HTTP requests answered, by API and status code",
                   ["api", "status"], registry=None)
TURNS = Counter("rlproxy_turns", "Model calls served, by API and turn type (main, side, "
                "opt_out)", ["api", "turn_type"], registry=None)
PROMPT_TOKENS = Counter("rlproxy_prompt_tokens", "Prompt tokens of served model calls",
                        registry=None)
CACHED_PROMPT_TOKENS = Counter("rlproxy_cached_prompt_tokens", "Prompt tokens whose KV came "
                               "from the prefix cache instead of prefill", registry=None)
COMPLETION_TOKENS = Counter("rlproxy_completion_tokens", "Completion tokens generated",
                            registry=None)
TTFT = Histogram("rlproxy_time_to_first_token_seconds", "Time from request to first token",
                 ["api"], buckets=LATENCY_BUCKETS, registry=None)
E2E = Histogram("rlproxy_e2e_request_latency_seconds", "Time from request to last token",
                ["api"], buckets=LATENCY_BUCKETS, registry=None)
TPOT = Histogram("rlproxy_time_per_output_token_seconds", "Decode time per output token after "
                 "the first", ["api"], buckets=PER_TOKEN_BUCKETS, registry=None)
JUDGE_CALLS = Counter("rlproxy_judge_calls", "Judge calls made (one per vote or hint)",
                      registry=None)
JUDGE_FAILURES = Counter("rlproxy_judge_failures", "Judge calls that failed", registry=None)
JUDGE_LATENCY = Histogram("rlproxy_judge_latency_seconds", "Time to score one turn (all its "
                          "judge calls)", buckets=LATENCY_BUCKETS, registry=None)
REWARD = Histogram("rlproxy_reward", "Reward of each scored turn when it was scored, and again "
                   "when /v1/feedback changes it",
                   buckets=REWARD_BUCKETS, registry=None)
STEP_TIME = Histogram("rlproxy_train_step_seconds", "Wall time of one optimizer step",
                      buckets=LATENCY_BUCKETS, registry=None)
LOSS = Gauge("rlproxy_train_loss", "Loss of the last optimizer step", registry=None)
KL = Gauge("rlproxy_train_kl", "Mean KL to the base model per token, last step", registry=None)
GRAD_NORM = Gauge("rlproxy_train_grad_norm", "Gradient norm of the last step (before clipping)",
                  registry=None)
REWARD_MEAN = Gauge("rlproxy_train_reward_mean", "Mean reward of the last step's turns",
                    registry=None)
STALENESS = Histogram("rlproxy_train_staleness_versions", "Adapter versions between the one "
                      "that sampled a trained turn and the one it trained (0: on-policy)",
                      buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64), registry=None)
SWAP_PAUSE = Histogram("rlproxy_adapter_swap_pause_seconds", "Decoding paused to apply a new "
                       "adapter", buckets=(.0001, .00025, .0005, .001, .0025, .005, .01, .025,
                                           .05, .1, .25), registry=None)
STALLED = Counter("rlproxy_client_stalled", "Streams cut off because their client read "
                  "nothing for --stall-timeout-s or fell too far behind, by API", ["api"],
                  registry=None)
OBSERVED = (REQUESTS, TURNS, PROMPT_TOKENS, CACHED_PROMPT_TOKENS, COMPLETION_TOKENS, TTFT, E2E,
            TPOT, JUDGE_CALLS, JUDGE_FAILURES, JUDGE_LATENCY, REWARD, STEP_TIME, LOSS, KL,
            GRAD_NORM, REWARD_MEAN, STALENESS, SWAP_PAUSE, STALLED)


# ---- observation points (one-line calls from the loop) ----

def observe_call(call) -> None:
    """A model call ended (api/turns.py `run_call`); never raises into the request."""
    try:
        gen, api = call.gen, call.api
        turn_type = (call.turn.turn_type if call.turn is not None
                     else "opt_out" if call.place is None else "unfinished")
        TURNS.labels(api, turn_type).inc()
        PROMPT_TOKENS.inc(len(call.prompt.ids))
        CACHED_PROMPT_TOKENS.inc(min((r.cached_tokens for r in gen.records), default=0))
        n = sum(len(r.completion_ids) for r in gen.records)
        COMPLETION_TOKENS.inc(n)
        if gen.first_token_at is None:
            return
        now = time.time()
        TTFT.labels(api).observe(gen.first_token_at - gen.started)
        recent_ttft.append((now, gen.first_token_at - gen.started))
        E2E.labels(api).observe(now - gen.started)
        per_choice = max((len(r.completion_ids) for r in gen.records), default=0)
        if per_choice > 1:
            TPOT.labels(api).observe((now - gen.first_token_at) / (per_choice - 1))
    except Exception:  # a metric must never fail a request
        pass


def observe_score(line: dict) -> None:
    """A turn was scored (scoring/scorer.py): its judge calls, latency and reward."""
    votes = line.get("votes") or []
    JUDGE_CALLS.inc(len(votes))
    JUDGE_FAILURES.inc(sum(1 for v in votes if v.get("error")))
    if votes or line.get("hint") is not None:
        JUDGE_LATENCY.observe(line.get("judge_latency_s") or 0.0)
    if line.get("reward") is not None:
        REWARD.observe(line["reward"])


def observe_train_step(line: dict) -> None:
    """One optimizer step's line for training.jsonl (training/loop.py)."""
    STEP_TIME.observe(line["step_time_s"])
    LOSS.set(line["loss"])
    KL.set(line["kl"])
    GRAD_NORM.set(line["grad_norm"])
    if line.get("reward_mean") is not None:
        REWARD_MEAN.set(line["reward_mean"])
    if line.get("epoch") == 0:  # each trained turn once, however many epochs
        for late in line.get("staleness") or []:
            if late is not None:
                STALENESS.observe(late)


def observe_swap(seconds: float, version: int) -> None:
    """The engine applied adapter VERSION, pausing decoding for SECONDS (serving/engine.py)."""
    SWAP_PAUSE.observe(seconds)
    logs.served["adapter_version"] = version


# ---- state read at scrape time ----

def resident_bytes() -> int | None:
    try:  # Linux: the second field of statm is resident pages
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _max_rss()  # macOS: the peak, the closest figure without psutil


def peak_resident_bytes() -> int:
    """The most resident memory this process has held (a training step's peak, mostly). The
    kernel updates its high-water mark lazily: never below the resident memory now."""
    return max(_max_rss(), resident_bytes() or 0)


def _max_rss() -> int:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes there, KiB on Linux


def process_memory() -> dict:
    """/healthz's `memory`: resident and peak resident bytes, and the same in GiB."""
    rss, peak = resident_bytes(), peak_resident_bytes()
    return {"rss_bytes": rss, "peak_rss_bytes": peak,
            "rss_gib": None if rss is None else round(rss / 2**30, 3),
            "peak_rss_gib": round(peak / 2**30, 3)}


def gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=float(value))


def counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=float(value))


class LiveCollector:
    """Counters and gauges of one app, read from what its components report."""

    def __init__(self, app: web.Application):
        self.app = app

    def collect(self):
        app = self.app
        gate = app.get(ADMISSION)
        if gate is not None:
            yield gauge("rlproxy_requests_admitted", "Generation requests running or waiting "
                        "(past --max-queued-requests a request gets 429)", gate.admitted)
        info = GaugeMetricFamily("rlproxy_info", "The served model", labels=["model"])
        info.add_metric([app[MODEL].model_id], 1)
        yield info
        engine = app[ENGINE]
        yield gauge("rlproxy_adapter_version", "Adapter version being served",
                    engine.adapter_version)
        yield counter("rlproxy_adapter_swaps", "Adapters applied by the engine",
                      engine.stats.swaps)
        yield gauge("rlproxy_running_requests", "Sequences in the decode batch",
                    engine.stats.active)
        yield counter("rlproxy_decode_steps", "Batched decode steps", engine.stats.steps)
        st = engine.stats
        yield counter("rlproxy_spec_steps", "Forward passes of speculated lone streams "
                      "(--speculate ngram)", st.spec_steps)
        yield counter("rlproxy_spec_tokens", "Tokens those passes yielded (tokens per step: "
                      "this over rlproxy_spec_steps)", st.spec_tokens)
        yield counter("rlproxy_spec_drafted_tokens", "Tokens drafted by prompt lookup",
                      st.spec_drafted)
        yield counter("rlproxy_spec_accepted_tokens", "Drafted tokens accepted (acceptance "
                      "rate: this over rlproxy_spec_drafted_tokens)", st.spec_accepted)
        yield gauge("rlproxy_adapter_merged", "1 while the live adapter is served merged "
                    "into the base weights (--merge-lora)", int(st.merged))
        yield gauge("rlproxy_adapter_merged_bytes", "Memory the merged weights hold beyond "
                    "the base", st.merged_bytes)
        if engine.prefix_cache is not None:
            yield from prefix_cache_metrics(engine.prefix_cache.health())
        store = app.get(SESSIONS)
        if store is not None:
            sessions = store.health()
            yield gauge("rlproxy_sessions_open", "Open sessions", sessions["open"])
            yield gauge("rlproxy_turns_awaiting_next_state", "Main turns waiting for the "
                        "session's next request", sessions["awaiting_next_state"])
        scorer = app.get(SCORER)
        if scorer is not None:
            s = scorer.stats
            yield counter("rlproxy_turns_scored", "Turns scored", s.scored)
            yield counter("rlproxy_turns_released", "Scored turns released to training",
                          s.released)
            yield gauge("rlproxy_turns_waiting_judge", "Turns waiting out a judge outage",
                        s.waiting)
            yield counter("rlproxy_judge_outages", "Turns deferred because no judge answered",
                          s.outages)
            yield gauge("rlproxy_scoring_pending", "Turns submitted and not scored yet",
                        scorer.pending)
        trainer = app.get(TRAINER)
        t = trainer.health() if trainer is not None else {"enabled": False}
        yield gauge("rlproxy_trainer_up", "1 while the trainer thread runs (0: off or died)",
                    int(t["enabled"] and t["alive"] and t["error"] is None))
        if trainer is not None:
            yield counter("rlproxy_train_steps", "Optimizer steps taken by this process "
                          "(not rollbacks)", trainer.stats.optimizer_steps)
            yield counter("rlproxy_turns_trained", "Turns trained on",
                          trainer.stats.turns_trained)
            yield counter("rlproxy_train_turns_skipped", "Turns skipped (too long, too big)",
                          trainer.stats.skipped)
            yield gauge("rlproxy_train_turns_quarantined", "Turns whose steps kept failing",
                        t["quarantined"])
            yield gauge("rlproxy_train_queue_depth", "Scored turns waiting for the trainer",
                        t["queued"])
            yield gauge("rlproxy_training_paused", "1 while training is paused",
                        int(t["paused"]))
        adapters = app.get(ADAPTERS)
        if adapters is not None:
            yield from personal_metrics(adapters.health()["adapters"])
        tinker = app.get(TINKER)
        if tinker is not None:
            yield from tinker_metrics(tinker.health())
        errors = CounterMetricFamily("rlproxy_disk_write_errors", "Record writes that failed "
                                     "(a full disk), by file; nothing of them was kept",
                                     labels=["path"])
        for path, n in records.write_errors().items():
            errors.add_metric([path], n)
        yield errors
        yield gauge("rlproxy_disk_write_failing", "Record files whose last write failed",
                    len(records.failing()))
        settings = app.get(SETTINGS)
        if settings is not None:
            yield from records_metrics(paths.records_size(settings.records.data_dir))
        rss = resident_bytes()
        if rss is not None:
            yield gauge("rlproxy_process_resident_memory_bytes", "Resident memory", rss)
        yield gauge("rlproxy_process_peak_resident_memory_bytes", "The most resident memory "
                    "the process has held (a long training step's, mostly)",
                    peak_resident_bytes())


def personal_metrics(adapters: dict):
    """From pipeline.py `Adapters.health()`: each personal adapter's figures, labelled."""
    yield gauge("rlproxy_personal_adapters", "Personal adapters made (MODEL:NAME, "
                "X-RL-Adapter)", len(adapters))
    rows = (("rlproxy_personal_adapter_version", "Version a personal adapter serves", "gauge",
             lambda a: a["version"]),
            ("rlproxy_personal_sessions_open", "A personal adapter's open sessions", "gauge",
             lambda a: a["sessions_open"]),
            ("rlproxy_personal_train_steps", "A personal adapter's optimizer steps by this "
             "process", "counter", lambda a: (a["trainer"] or {}).get("optimizer_steps", 0)),
            ("rlproxy_personal_turns_trained", "Turns a personal adapter trained on",
             "counter", lambda a: (a["trainer"] or {}).get("turns_trained", 0)),
            ("rlproxy_personal_train_queue_depth", "Released turns a personal adapter has not "
             "trained yet", "gauge", lambda a: (a["trainer"] or {}).get("untrained", 0)))
    for name, doc, kind, value in rows:
        family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
            name, doc, labels=["adapter"])
        for adapter, a in sorted(adapters.items()):
            family.add_metric([adapter], float(value(a)))
        yield family


def prefix_cache_metrics(c: dict):
    """From the prefix cache's `health()`."""
    yield counter("rlproxy_prefix_cache_lookups", "Prefix cache lookups", c["lookups"])
    yield counter("rlproxy_prefix_cache_hits", "Lookups that restored a prefix", c["hits"])
    yield counter("rlproxy_prefix_cache_misses", "Lookups that found nothing", c["misses"])
    yield counter("rlproxy_prefix_cache_stores", "Entries written", c["stores"])
    size = GaugeMetricFamily("rlproxy_prefix_cache_bytes", "Bytes held", labels=["tier"])
    size.add_metric(["disk"], c["disk_bytes"])
    size.add_metric(["memory"], c["memory_bytes"])
    yield size
    evicted = CounterMetricFamily("rlproxy_prefix_cache_evictions", "Entries evicted, by "
                                  "reason (stale: adapter left the reuse window; budget: "
                                  "disk limit)", labels=["reason"])
    evicted.add_metric(["stale"], c["evicted_stale"])
    evicted.add_metric(["budget"], c["evicted_budget"])
    yield evicted


def records_metrics(size: dict):
    """From paths.records_size: the record files' bytes on disk, by file and in all."""
    files = GaugeMetricFamily("rlproxy_records_bytes", "Bytes on disk of a record file (with "
                              "its set-aside copies), by file", labels=["file"])
    for name, n in size["files"].items():
        files.add_metric([name], n)
    yield files
    yield gauge("rlproxy_records_total_bytes", "Bytes on disk of all the record files",
                size["bytes"])
    yield gauge("rlproxy_checkpoints_bytes", "Bytes on disk of the kept checkpoints",
                size["checkpoints_bytes"])


def tinker_metrics(t: dict):
    """From the Tinker API's `health()` (tinker/state.py)."""
    yield gauge("rlproxy_tinker_models", "Tinker training runs in memory (a named run shared "
                "by several clients counts once)", t["models"])
    yield gauge("rlproxy_tinker_handles", "Tinker training clients (handles) bound to a run",
                t["handles"])
    yield gauge("rlproxy_tinker_samplers", "Tinker sampling sessions open", t["samplers"])
    yield counter("rlproxy_tinker_forward_backward", "Tinker forward_backward calls that "
                  "accumulated gradients (forward-only calls not counted)", t["forward_backward"])
    yield counter("rlproxy_tinker_optim_steps", "Tinker optimizer steps applied",
                  t["optim_steps"])


# ---- wiring ----

def make_registry(app: web.Application) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LiveCollector(app))
    for metric in OBSERVED:
        registry.register(metric)
    return registry


async def metrics_handler(request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(request.app[METRICS]),
                        headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})
