"""GET /metrics: Prometheus' own parser reads it, its counters move with real traffic and a real
training step, and it sits behind the API key unless --metrics-public."""

from __future__ import annotations

import io
import json
import logging
import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from conftest import ServerThread, make_settings, server_with
from demo_agent import run_sessions, training_settings, wait_for_steps
from rlproxy.ops.logs import JsonFormatter

KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def scrape(url: str, headers=AUTH) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of one scrape, parsed by prometheus_client."""
    r = requests.get(url + "/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


keyed = server_with(api_key=KEY)


def test_metrics_parse_and_counters_move_with_requests(keyed):
    before = scrape(keyed.url)
    families = {f.name for f in text_string_to_metric_families(
        requests.get(keyed.url + "/metrics", headers=AUTH).text)}
    for name in ("rlproxy_requests", "rlproxy_time_to_first_token_seconds",
                 "rlproxy_e2e_request_latency_seconds", "rlproxy_time_per_output_token_seconds",
                 "rlproxy_prompt_tokens", "rlproxy_cached_prompt_tokens",
                 "rlproxy_completion_tokens", "rlproxy_running_requests",
                 "rlproxy_prefix_cache_hits", "rlproxy_prefix_cache_misses",
                 "rlproxy_prefix_cache_bytes", "rlproxy_prefix_cache_evictions",
                 "rlproxy_sessions_open", "rlproxy_turns_awaiting_next_state",
                 "rlproxy_judge_calls", "rlproxy_judge_failures", "rlproxy_judge_latency_seconds",
                 "rlproxy_reward", "rlproxy_turns_scored", "rlproxy_turns_released",
                 "rlproxy_turns_waiting_judge", "rlproxy_adapter_version",
                 "rlproxy_adapter_swap_pause_seconds", "rlproxy_train_step_seconds",
                 "rlproxy_train_staleness_versions",
                 "rlproxy_process_resident_memory_bytes"):
        assert name in families, name
    client = keyed.client(api_key=KEY)
    messages = [{"role": "user", "content": "Count to three."}]
    first = client.chat.completions.create(
        model="m", messages=messages, max_tokens=6, temperature=0,
        extra_headers={"X-Session-Id": "metrics-1"})
    client.chat.completions.create(  # the session's second turn: the first gets a next state
        model="m", max_tokens=6, temperature=0, extra_headers={"X-Session-Id": "metrics-1"},
        messages=messages + [{"role": "assistant", "content": first.choices[0].message.content},
                             {"role": "user", "content": "Again."}])
    after = scrape(keyed.url)
    moved = lambda name, **kw: value(after, name, **kw) - value(before, name, **kw)  # noqa: E731
    assert moved("rlproxy_requests_total", api="chat", status="200") == 2
    assert moved("rlproxy_turns_total", api="chat", turn_type="main") == 2
    assert moved("rlproxy_time_to_first_token_seconds_count", api="chat") == 2
    assert moved("rlproxy_e2e_request_latency_seconds_count", api="chat") == 2
    assert moved("rlproxy_prompt_tokens_total") > first.usage.prompt_tokens  # both prompts
    assert moved("rlproxy_completion_tokens_total") >= 2
    assert moved("rlproxy_prefix_cache_lookups_total") == 2
    # the second request continued the first: its prompt starts with the first turn's KV
    assert moved("rlproxy_prefix_cache_hits_total") == 1
    assert moved("rlproxy_cached_prompt_tokens_total") > 0
    assert value(after, "rlproxy_turns_awaiting_next_state") >= 1  # the second turn
    assert value(after, "rlproxy_sessions_open") >= 1


def test_healthz_and_metrics_give_resident_memory_and_its_peak(keyed):
    """The server runs in this process: what it says lies between this process's own readings
    taken before and after (the peak only grows; Linux counts it in KiB and updates it lazily,
    so it is at least the resident memory now)."""
    import resource

    def peak():
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * resource.getpagesize()
        return max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss)

    low = peak()
    memory = requests.get(keyed.url + "/healthz").json()["memory"]
    samples = scrape(keyed.url)
    high = peak()
    assert low <= memory["peak_rss_bytes"] <= high
    assert 0 < memory["rss_bytes"] <= memory["peak_rss_bytes"]
    assert memory["peak_rss_gib"] == round(memory["peak_rss_bytes"] / 2**30, 3)
    assert low <= value(samples, "rlproxy_process_peak_resident_memory_bytes") <= high
    assert 0 < value(samples, "rlproxy_process_resident_memory_bytes") <= high


def test_metrics_need_the_key_unless_public(keyed, tiny, tmp_path):
    assert requests.get(keyed.url + "/metrics").status_code == 401
    assert requests.get(keyed.url + "/metrics", headers={"x-api-key": KEY}).status_code == 200
    with ServerThread(make_settings(tmp_path, api_key=KEY, metrics_public=True), tiny) as s:
        assert scrape(s.url, headers={})  # no key needed for /metrics ...
        assert requests.get(s.url + "/ui/api/overview").status_code == 401  # ... only there
        assert requests.get(s.url + "/v1/models").status_code == 401


def test_a_training_step_moves_the_trainer_metrics(keyed, tmp_path):
    # the histograms are process-wide: let the other server finish scoring its turns first
    deadline = time.monotonic() + 60
    while value(scrape(keyed.url), "rlproxy_scoring_pending") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with ServerThread(training_settings(tmp_path)) as s:
        before = scrape(s.url, headers={})
        assert value(before, "rlproxy_trainer_up") == 1
        run_sessions(s.url, 0, 1)
        wait_for_steps(s.url, 1)
        deadline = time.monotonic() + 30  # a step's turns count once the step has returned
        while requests.get(s.url + "/healthz").json()["trainer"]["turns_trained"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        after = scrape(s.url, headers={})
        # a rollback takes a step number of its own, but it is no optimizer step
        assert requests.post(s.url + "/v1/adapters/1/serve").status_code == 200
        rolled = scrape(s.url, headers={})
    assert value(after, "rlproxy_train_steps_total") == 1
    assert value(rolled, "rlproxy_train_steps_total") == 1
    assert value(rolled, "rlproxy_adapter_version") == 2
    assert value(after, "rlproxy_turns_trained_total") == 2
    assert value(after, "rlproxy_train_step_seconds_count") - value(
        before, "rlproxy_train_step_seconds_count") == 1
    assert value(after, "rlproxy_adapter_version") == 1
    assert value(after, "rlproxy_adapter_swaps_total") >= 1
    assert value(after, "rlproxy_reward_count") - value(before, "rlproxy_reward_count") == 2
    assert value(after, "rlproxy_turns_scored_total") == 2
    assert value(after, "rlproxy_turns_released_total") == 2
    assert value(after, "rlproxy_train_grad_norm") > 0


def test_json_log_lines_carry_session_turn_and_adapter_version(keyed):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("rlproxy")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        client = keyed.client(api_key=KEY)
        messages = [{"role": "user", "content": "Hello there."}]
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                               extra_headers={"X-Session-Id": "log-1"})
        client.chat.completions.create(  # gives the first turn its next state: it is scored
            model="m", max_tokens=4, extra_headers={"X-Session-Id": "log-1"},
            messages=messages + [{"role": "assistant", "content": first.choices[0].message.content},
                                 {"role": "user", "content": "And?"}])
        deadline = time.monotonic() + 60
        while "scored session=log-1" not in stream.getvalue():
            assert time.monotonic() < deadline, stream.getvalue()
            time.sleep(0.1)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    scored = next(ln for ln in lines if ln["message"].startswith("scored session=log-1"))
    assert scored["session_id"] == "log-1" and len(scored["turn_uid"]) == 32
    assert scored["level"] == "INFO" and scored["logger"] == "rlproxy.scorer"
    assert isinstance(scored["adapter_version"], int)


def test_log_format_json_in_the_config_file_is_applied(tmp_path):
    """`rlproxy serve --config` with [server] log_format = "json": the log lines are JSON (the
    app is built for real; only server.run_app (aiohttp's runner) is replaced by one log line)."""
    import os
    import subprocess
    import sys

    config = tmp_path / "rlproxy.toml"
    config.write_text(f'[server]\nlog_format = "json"\n\n[model]\nmodel = "tiny"\n\n[records]\ndata_dir = "{tmp_path}"\n')
    code = ("import logging, rlproxy.api.server as w\n"
            "w.run_app = lambda app, **kw: logging.getLogger('rlproxy.t').warning('hello')\n"
            "from rlproxy.cli import main\n"
            f"main(['serve', '--config', {str(config)!r}])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPROXY_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    line = [ln for ln in out.stderr.splitlines() if "hello" in ln][-1]
    assert json.loads(line)["message"] == "hello"


def test_a_client_that_hangs_up_is_counted_as_499_not_500(keyed):
    before = scrape(keyed.url)
    with requests.post(keyed.url + "/v1/chat/completions", headers=AUTH, stream=True, json={
            "model": "m", "stream": True, "max_tokens": 2000, "temperature": 1.0,
            "messages": [{"role": "user", "content": "Write a long story."}]}) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first chunk, then hang up mid-stream
    deadline = time.monotonic() + 30
    while True:
        after = scrape(keyed.url)
        moved = lambda status: value(after, "rlproxy_requests_total", api="chat",  # noqa: E731
                                     status=status) - value(before, "rlproxy_requests_total",
                                                            api="chat", status=status)
        if moved("499") or moved("500") or moved("200") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert moved("499") == 1 and moved("500") == 0
