"""X-Request-Id over real HTTP: concurrent repeats generate one turn; when the attempt that runs
fails (its client dropped the stream), exactly one waiting repeat runs anew and the others wait
for it; nothing is generated or recorded twice."""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest
import requests

from rlproxy.appkeys import ENGINE, MODEL, SESSIONS

from conftest import read_records


def body(server, stream: bool, max_tokens: int = 8, long: bool = False) -> dict:
    b = {"model": "m", "messages": [{"role": "user", "content": "tell me a story"}],
         "max_tokens": max_tokens, "stream": stream, "temperature": 1.0}
    if long:  # no end of sequence: the attempt runs until max_tokens
        b["logit_bias"] = {str(t): -100 for t in server.app[MODEL].tokenizer.eos_token_ids}
    return b


async def post(http: aiohttp.ClientSession, url: str, b: dict, headers: dict) -> dict:
    """One request read to its end: status, whether it was a replay, and its text."""
    async with http.post(url, json=b, headers=headers) as r:
        raw = await r.read()
        out = {"status": r.status, "replay": r.headers.get("X-Idempotent-Replay") == "true"}
    if out["status"] != 200:
        out["text"] = raw.decode()
    elif b["stream"]:
        assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
        out["text"] = "".join(
            json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in raw.split(b"\n\n") if line.startswith(b"data: {")
            and json.loads(line[6:])["choices"])
    else:
        out["text"] = json.loads(raw)["choices"][0]["message"]["content"]
    return out


def recorded(server, sid: str, rid: str) -> list[dict]:
    """The turns recorded or journaled with this X-Request-Id, once each."""
    requests.post(f"{server.base_url}/sessions/{sid}/end")
    server.app[SESSIONS].flushed().result(timeout=30)
    data = server.settings.records.data_dir
    turns = read_records(data) + read_records(data, "pending_turns.jsonl")
    return list({r["uid"]: r for r in turns if r.get("request_id") == rid}.values())


@pytest.mark.parametrize("streams", [[False] * 10, [True] * 10, [True, False] * 5],
                         ids=["plain", "streamed", "mixed"])
def test_ten_concurrent_repeats_generate_one_turn(server, streams):
    sid, rid = f"idem-{len(set(streams))}-{streams[0]}", f"rid-{time.monotonic_ns()}"
    headers = {"X-Session-Id": sid, "X-Request-Id": rid}
    url = server.base_url + "/chat/completions"
    generated = server.app[ENGINE].stats.requests

    async def fire():
        async with aiohttp.ClientSession() as http:
            return await asyncio.gather(*[post(http, url, body(server, s, 48), headers)
                                          for s in streams])

    results = asyncio.run(fire())
    assert [r["status"] for r in results] == [200] * 10, results
    assert sum(not r["replay"] for r in results) == 1, results
    assert len({r["text"] for r in results}) == 1, results
    assert server.app[ENGINE].stats.requests - generated == 1
    assert len(recorded(server, sid, rid)) == 1


@pytest.mark.parametrize("first_streams", [True, False], ids=["stream", "plain"])
def test_dropped_attempt_is_run_again_by_exactly_one_repeat(server, first_streams):
    sid, rid = f"drop-{first_streams}", f"rid-{time.monotonic_ns()}"
    headers = {"X-Session-Id": sid, "X-Request-Id": rid}
    url = server.base_url + "/chat/completions"
    generated = server.app[ENGINE].stats.requests
    engine = server.app[ENGINE]

    async def scenario():
        async with aiohttp.ClientSession() as http:
            # the first attempt: long, dropped by its client part way through
            first = asyncio.create_task(http.post(
                url, json=body(server, first_streams, 4000, long=True), headers=headers))
            while engine.stats.active == 0:  # it is generating
                await asyncio.sleep(0.01)
            repeats = [asyncio.create_task(post(http, url, body(server, s, 24), headers))
                       for s in (True, False, True, False, True)]
            await asyncio.sleep(0.5)  # all five arrived and wait for the first attempt
            assert not any(t.done() for t in repeats)
            if first_streams:  # its headers are in: close the stream part way through
                (await first).close()
            else:  # still waiting for the body: drop the connection
                first.cancel()
            return await asyncio.gather(*repeats)

    results = asyncio.run(scenario())
    assert [r["status"] for r in results] == [200] * 5, results
    assert sum(not r["replay"] for r in results) == 1, results  # one ran anew, four waited
    assert len({r["text"] for r in results}) == 1, results
    assert server.app[ENGINE].stats.requests - generated == 2  # the dropped one + one
    turns = recorded(server, sid, rid)
    assert len(turns) == 1 and turns[0]["sampling"]["max_tokens"] == 24


def test_attempt_dropped_after_its_turn_was_filed_is_replayed_not_run_again(server,
                                                                              monkeypatch):
    """The client goes away while its filed turn is being made durable (a slow disk): the
    turn stays recorded, and a repeat gets it instead of a second one."""
    requests.post(server.base_url + "/chat/completions", headers={"X-RL-Opt-Out": "1"},
                  json=body(server, True, 8))  # warm: no token comes 1.5 s after another
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (time.sleep(3.0), real(fd)))
    sid, rid = "drop-filed", f"rid-{time.monotonic_ns()}"
    headers = {"X-Session-Id": sid, "X-Request-Id": rid}
    url = server.base_url + "/chat/completions"

    async def scenario():
        async with aiohttp.ClientSession() as http:
            first = await http.post(url, json=body(server, True, 8), headers=headers)
            while True:  # read until the stream stalls: the turn is filed, waiting for disk
                try:
                    await asyncio.wait_for(first.content.readline(), 1.5)
                except TimeoutError:
                    break
            first.close()
            await asyncio.sleep(3.5)  # the filed turn is on disk
            return await post(http, url, body(server, False, 8), headers)

    again = asyncio.run(scenario())
    assert again["status"] == 200
    assert len(recorded(server, sid, rid)) == 1
    assert again["replay"]
