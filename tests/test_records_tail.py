"""`rlproxy records tail` tells where each turn stands (issue 41): a turn waiting for its next
state (pending_turns.jsonl), one waiting for the judge, and each scored turn's reward and why;
and feedback after scoring writes a `rescore` line with the reward the turn was trained with (the
score line keeps what scoring said). The real app on a real port, driven by the real openai SDK,
judged by test_scoring's scripted judge on a real port; the command run as `rlproxy` runs."""

from __future__ import annotations

import requests

from rlproxy.cli import main
from test_scoring import Judge, lines, proxy, wait_for, wait_lines, wait_scored


def turn(server, sid: str, messages: list[dict], **headers) -> list[dict]:
    r = server.client().chat.completions.create(
        model="m", messages=messages, max_tokens=4, seed=1,
        extra_headers={"X-Session-Id": sid, **headers})
    return messages + [{"role": "assistant", "content": r.choices[0].message.content}]


def blocks(out: str) -> dict[str, str]:
    """`rlproxy records tail`'s output, one block per turn, by "session #index"."""
    found, key = {}, None
    for line in out.splitlines():
        if not line.startswith(" "):
            key = " ".join(line.split()[1:3])  # "session #index"
            found[key] = line
        else:
            found[key] += "\n" + line
    return found


def test_tail_shows_pending_turns_and_each_reward_with_why(tiny, tmp_path, capsys):
    with Judge() as judge, proxy(tiny, tmp_path, judge, at_least_one=False) as s:
        ask = [{"role": "user", "content": "Please check the weather."}]
        done = turn(s, "judged", ask)
        turn(s, "judged", done + [{"role": "user", "content": "[votes 1,1,1] thanks"}])
        wait_scored(s, 1)
        # a person disagrees after scoring: released again with -1, and said in a rescore line
        r = requests.post(s.base_url + "/feedback", json={
            "session_id": "judged", "turn_index": 0, "reward": -1.0, "comment": "wrong city"})
        assert r.json()["status"] == "rescored"
        wait_lines(tmp_path, "rescore", 1)
        wait_for(lambda: [x["reward"] for x in lines(tmp_path, "release")] == [1, -1],
                 what="the second release")
        # a judge outage: recorded, its score waits
        judge.down = True
        first = turn(s, "outage", ask)
        turn(s, "outage", first + [{"role": "user", "content": "ok"}], **{"X-Session-Done": "1"})
        wait_for(lambda: requests.get(s.url + "/healthz").json()["scoring"]["waiting"] >= 1,
                 what="a turn waiting out the outage")

        (score,) = [x for x in lines(tmp_path, "score") if x["session_id"] == "judged"]
        (rescore,) = lines(tmp_path, "rescore")
        assert score["index"] == 0 and score["reward"] == 1  # what the judge said, kept
        assert (rescore["uid"], rescore["reward"], rescore["was"], rescore["feedback"],
                rescore["status"]) == (score["uid"], -1, 1, -1, "rescored")

        assert main(["records", "tail", "--data-dir", str(tmp_path)]) == 0
        got = blocks(capsys.readouterr().out)
    assert "reward -1, trained with: feedback -1 after scoring (rescored; the score line " \
        "said +1)" in got["judged #0"]
    assert "next: user: [votes 1,1,1] thanks" in got["judged #0"]
    assert got["judged #1"].endswith("pending: waiting for its next state")
    assert got["outage #0"].endswith("waiting for the judge (not scored yet)")
    assert "(no next state: session_done)" in got["outage #1"]
    assert got["outage #1"].endswith("not judged: no next state (session_done)")
    assert list(got) == ["judged #0", "outage #0", "outage #1", "judged #1"]  # pending last


def test_tail_says_why_a_turn_is_not_trained(tiny, tmp_path, capsys):
    """A cut reply (scoring/notes.py), a side turn and a turn the client opted out of training."""
    with Judge() as judge, proxy(tiny, tmp_path, judge, at_least_one=False,
                                 judge_cut_turns=False) as s:
        ask = [{"role": "user", "content": "Please check the weather."}]
        first = turn(s, "cut", ask)
        turn(s, "cut", first + [{"role": "user", "content": "[votes 1,1,1] thanks"}],
             **{"X-Session-Done": "1"})
        turn(s, "side", ask, **{"X-Turn-Type": "side", "X-Session-Done": "1"})
        turn(s, "off", ask, **{"X-RL-Train": "0", "X-Session-Done": "1"})
        wait_scored(s, 2)
        assert main(["records", "tail", "--data-dir", str(tmp_path)]) == 0
        got = blocks(capsys.readouterr().out)
    assert "[cut at its budget]" in got["cut #0"]
    assert got["cut #0"].endswith("reward none, not trained: not judged: the reply was cut at "
                                  "its completion budget")
    assert got["side #0"].endswith("not trained: a side turn (header)")
    assert got["off #0"].endswith("not trained: header")
