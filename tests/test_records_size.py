"""The records' size on disk (issue 37: records that grow with new tokens): `paths.records_size`
on a folder made by hand, then /healthz `records`, the /metrics gauges and the dashboard's
overview on a real server, against `os.path.getsize` of the files, before and after turns are
recorded."""

from __future__ import annotations

import os
import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from conftest import server_with
from rlproxy import paths
from rlproxy.appkeys import SESSIONS

NAMES = ("conversations.jsonl", "pending_turns.jsonl", "prm_scores.jsonl", "training.jsonl",
         "train_journal.jsonl")

server = server_with()


def on_disk(data_dir) -> dict[str, int]:
    """Each record file's bytes with its `<name>*` siblings (files only), by os.path.getsize."""
    files = [os.path.join(data_dir, f) for f in os.listdir(data_dir)]
    return {name: sum(os.path.getsize(f) for f in files
                      if os.path.basename(f).startswith(name) and os.path.isfile(f))
            for name in NAMES}


def gauges(url: str) -> dict[tuple, float]:
    text = requests.get(url + "/metrics").text
    return {(s.name, s.labels.get("file")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def settled(server, deadline_s: float = 60.0) -> tuple[dict, dict]:
    """(/healthz `records`, the files on disk) once they agree, read on both sides of /healthz:
    the scorer may still be writing in the background."""
    end = time.time() + deadline_s
    while True:
        before = on_disk(server.data_dir)
        records = requests.get(server.url + "/healthz").json()["records"]
        if records["files"] == before == on_disk(server.data_dir) or time.time() > end:
            return records, before
        time.sleep(0.2)


def test_records_size_counts_each_file_its_siblings_and_the_checkpoints(tmp_path):
    assert paths.records_size(tmp_path / "none") == {
        "bytes": 0, "files": dict.fromkeys(NAMES, 0), "checkpoints_bytes": 0}
    (tmp_path / "conversations.jsonl").write_bytes(b"x" * 100)
    (tmp_path / "conversations.jsonl.corrupt-20260101-000000").write_bytes(b"x" * 10)
    (tmp_path / "training.jsonl").write_bytes(b"x" * 7)
    (tmp_path / "prm_scores.jsonl.d").mkdir()  # a folder is not a record file
    (tmp_path / "rlproxy.lock").write_bytes(b"123\n")  # nor is anything else
    step = tmp_path / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    (step / "adapters.safetensors").write_bytes(b"w" * 1000)
    (step / "trainer_state.json").write_bytes(b"{}")
    size = paths.records_size(tmp_path)
    assert size["files"] == {**dict.fromkeys(NAMES, 0), "conversations.jsonl": 110,
                             "training.jsonl": 7}
    assert size["bytes"] == 117 == sum(on_disk(tmp_path).values())
    assert size["checkpoints_bytes"] == 1002


def test_healthz_metrics_and_dashboard_show_the_records_growing(server):
    start, disk = settled(server)
    assert start["bytes"] == sum(disk.values())
    client = server.client()
    messages = [{"role": "user", "content": "Count to three."}]
    first = client.chat.completions.create(
        model="m", messages=messages, max_tokens=8, temperature=0,
        extra_headers={"X-Session-Id": "size-1"})
    server.app[SESSIONS].flushed().result(timeout=30)
    pending, disk = settled(server)
    assert pending["bytes"] == sum(disk.values()) > start["bytes"]
    assert pending["files"]["pending_turns.jsonl"] > start["files"]["pending_turns.jsonl"]

    # the second turn gives the first its next state: it is filed in conversations.jsonl
    client.chat.completions.create(
        model="m", max_tokens=8, temperature=0, extra_headers={"X-Session-Id": "size-1"},
        messages=messages + [{"role": "assistant", "content": first.choices[0].message.content},
                             {"role": "user", "content": "Again."}])
    server.app[SESSIONS].flushed().result(timeout=30)
    end = time.time() + 120  # the first turn is scored next: then nothing more is written
    while requests.get(server.url + "/healthz").json()["scoring"]["scored"] < 1:
        assert time.time() < end, "the first turn was never scored"
        time.sleep(0.2)
    grown, disk = settled(server)
    assert grown["bytes"] == sum(disk.values()) > pending["bytes"]
    assert grown["files"]["conversations.jsonl"] > start["files"]["conversations.jsonl"]

    samples = gauges(server.url)
    health = requests.get(server.url + "/healthz").json()["records"]
    assert samples[("rlproxy_records_total_bytes", None)] == health["bytes"]
    assert {name: samples[("rlproxy_records_bytes", name)] for name in NAMES} == health["files"]
    assert samples[("rlproxy_checkpoints_bytes", None)] == health["checkpoints_bytes"]

    overview = requests.get(server.url + "/ui/api/overview").json()
    assert overview["records"] == requests.get(server.url + "/healthz").json()["records"]
    assert "records on disk" in requests.get(server.url + "/ui/static/app.js").text
