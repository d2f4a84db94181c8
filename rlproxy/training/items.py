"""The scorer -> trainer item: its key (`item_key`, `item_choice`, defined in training/journal.py,
which keys steps by them), and rebuilding every released item from the records after a restart
(`released_turns`).

An item (TEAM.md) is {"turn": record, "choice": index into turn["choices"], "key": the turn's
uid for its chosen choice, f"{uid}/{i}" for another choice, "reward", "advantages" (per
completion token of that choice), "baselined": True when a group baseline was already
subtracted, "teacher_logprobs", "update"}. Items from before choices were keyed carry none of
"choice", "key", "baselined": they mean the chosen choice, keyed by the uid.

Not here: training them, the keys the trainer has handled (training/loop.py), the journal of
steps (training/journal.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from rlproxy.paths import CONVERSATIONS, SCORES
from rlproxy.records import read_jsonl
from rlproxy.scoring.judging import released_item
from rlproxy.training.journal import item_choice, item_key, quarantined_uids

__all__ = ["item_choice", "item_key", "released_turns"]


def released_turns(data_dir: Path, w_opd: float, w_rl: float,
                   skip: Iterable[str] = frozenset(), max_attempts: int = 2) -> list[dict]:
    """Every item released for training in DATA_DIR's records, one per released choice (the
    latest release of a key wins), rebuilt by scoring.released_item into what the scorer hands
    the trainer live, less keys in SKIP and quarantined ones (training/journal.py). Release lines
    from before choices were keyed mean the chosen choice. Used to resume and by
    `rlproxy train`."""
    skip = set(skip) | quarantined_uids(data_dir, max_attempts)
    scores, releases = {}, {}
    for line in read_jsonl(Path(data_dir) / SCORES):
        if line.get("kind") == "score":
            scores[line["uid"]] = line
        elif line.get("kind") == "release":
            releases.setdefault(line["uid"], {})[line.get("key") or line["uid"]] = line
    out = []
    for turn in read_jsonl(Path(data_dir) / CONVERSATIONS):
        for key, release in releases.get(turn.get("uid"), {}).items():
            if key not in skip:
                item = released_item(turn, scores.get(turn["uid"], {}), release, w_opd, w_rl)
                out += [item] if item is not None else []
    return out
