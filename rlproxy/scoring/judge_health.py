"""Is the judge a sensor? Counts of its verdicts, of what at-least-one lifted, and of its
agreement with explicit feedback, for /healthz ("scoring" -> "judge"), `rlproxy status` and the
dashboard. The Scorer owns one and feeds it its score and release lines (read back at start-up,
then live); this module reads no file and knows nothing of judges or the ledger.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class JudgeHealth:
    """Is the judge a sensor? Counted over the chosen choices' score and release lines in
    prm_scores.jsonl (read back at start-up, then live)."""

    good: int = 0  # decided verdicts > 0
    bad: int = 0  # decided verdicts < 0
    undecided: int = 0  # judged, but no verdict or a margin under --prm-min-margin
    skipped: int = 0  # not judged: feedback or a reward function decided it (override)
    cut: int = 0  # not judged: cut at its budget, or only the agent's own note followed
    lifted: int = 0  # turns at-least-one released with +1
    released: int = 0  # turns released (chosen choices; feedback re-releases not counted)
    feedback_agree: int = 0  # explicit feedback and a decided verdict with the same sign
    feedback_disagree: int = 0  # ... with opposite signs

    def count(self, line: dict) -> None:
        """A score line: its verdict, and the feedback it was scored with."""
        if line.get("judge_skipped"):
            self.skipped += 1
        elif line.get("cut") and not line.get("judged"):  # scoring/notes.py
            self.cut += 1
        elif line.get("judge_reward") is not None:
            if line["judge_reward"] > 0:
                self.good += 1
            elif line["judge_reward"] < 0:
                self.bad += 1
        elif line.get("judged"):
            self.undecided += 1
        self.compare(line.get("judge_reward"), line.get("feedback"))

    def compare(self, judge: float | None, feedback: float | None) -> None:
        """Explicit feedback met a decided verdict: do they agree?"""
        if judge is None or feedback is None or judge == 0 or feedback == 0:
            return
        if (judge > 0) == (feedback > 0):
            self.feedback_agree += 1
        else:
            self.feedback_disagree += 1

    def summary(self) -> dict:
        judged = self.good + self.bad + self.undecided
        both = self.feedback_agree + self.feedback_disagree
        return {**asdict(self),
                "undecided_share": self.undecided / judged if judged else None,
                "lifted_share": self.lifted / self.released if self.released else None,
                "feedback_agreement": self.feedback_agree / both if both else None}
