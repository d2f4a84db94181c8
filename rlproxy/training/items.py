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

import logging
from pathlib import Path
from typing import Iterable

from rlproxy.paths import CONVERSATIONS, SCORES, segment_dirs
from rlproxy.records import numbered_jsonl, read_turns
from rlproxy.scoring.judging import released_item
from rlproxy.training.journal import item_choice, item_key, quarantined_uids

__all__ = ["item_choice", "item_key", "released_turns"]
log = logging.getLogger("rlproxy.trainer")


def released_turns(data_dir: Path, w_opd: float, w_rl: float,
                   skip: Iterable[str] = frozenset(), max_attempts: int = 2) -> list[dict]:
    """Every item released for training in DATA_DIR's records, one per released choice (the
    latest release of a key wins), rebuilt by scoring.released_item into what the scorer hands
    the trainer live, less keys in SKIP and quarantined ones (training/journal.py). Release lines
    from before choices were keyed mean the chosen choice. Reads DATA_DIR's segments
    (compaction.py), oldest first, then its live files (so after a compaction the same items
    come, the compacted sessions' first). Used to resume and by `rlproxy train`. A line it
    cannot use is skipped with a WARNING naming it."""
    skip = set(skip) | quarantined_uids(data_dir, max_attempts)
    # the segments of compacted sessions (compaction.py), oldest first, then the live files
    folders = [*segment_dirs(data_dir), Path(data_dir)]
    scores, releases = {}, {}
    for path in (folder / SCORES for folder in folders):
        for number, line in numbered_jsonl(path, report_cut=True):
            if not isinstance(line.get("uid"), str):
                log.warning("%s: line %d has no uid; skipped", path, number)
            elif line.get("kind") == "score":
                scores[line["uid"]] = line
            elif line.get("kind") == "release":
                releases.setdefault(line["uid"], {})[line.get("key") or line["uid"]] = line
    out, seen = [], set()  # a crash mid-compaction may leave a turn in two files: taken once
    for path in (folder / CONVERSATIONS for folder in folders):
        for number, turn in read_turns(path, report_cut=True):  # whole, whichever form
            uid = turn.get("uid")
            if uid in seen:
                continue
            seen.add(uid)
            for key, release in (releases.get(uid, {}) if isinstance(uid, str) else {}).items():
                if key in skip:
                    continue
                try:
                    item = released_item(turn, scores.get(uid, {}), release, w_opd, w_rl)
                except (KeyError, IndexError, TypeError, ValueError) as e:
                    log.warning("%s: line %d is not a turn that can be trained (%s: %s); "
                                "skipped", path, number, type(e).__name__, e)
                    break
                out += [item] if item is not None else []
    return out
