"""Data-parallel training over the ranks of an `mlx.launch` (mx.distributed).

`mlx.launch --hosts mac1,mac2 -- rlproxy serve …` (or `rlproxy train --from …`) runs the same
command on every rank. Rank 0 does all that one process does: HTTP, records, the trainer loop,
checkpoints. Its learner is a ParallelLearner: each forward_backward splits the batch into one
shard per rank, balanced by tokens (a packed session is one example, so it stays on one rank),
sends the other ranks theirs, computes its own, and sums the gradients over the ranks with one
`all_sum` (the loss figures come back in the ranks' answers). Every rank applies the identical
AdamW update (optim_step is sent to the others too), so the adapters stay equal without being
shipped; after anything else changes rank 0's state (a resumed checkpoint, a rollback, the eval
gate's measurements) the next call sends the whole state first. The other ranks run `work`: a
gradient worker on its own copy of the model, with no HTTP and no data dir, for the trainer and
for the Tinker API (tinker/ranks.py).

Exact: every rank divides its examples' losses by the whole batch's trained tokens, and the
figures are sums, so a step equals one process's up to the order of summation.

Failure: each exchange on rank 0 is waited for at most `distributed_timeout_s` (training/
rank_link.py). Past that, or on an error (a rank that exits closes its connection), the group is
broken for good: RankFailed, a LearnerUnavailable, so the batch waits with no turn charged,
/healthz says what failed, and serving goes on. A rank whose shard raises fails the step on
every rank (ShardFailed: retried, charged only as a learner's repeated failure). mlx.launch
SIGTERMs rank 0 when another rank exits with an error: rank 0 then serves on (`outlive`).
Training resumes when the launch is restarted.

Not here: the messages and sums (training/rank_link.py); what a step trains (training/loop.py);
one sequence's gradient (chunked_grad.py).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from rlproxy.ops.ranks import launched_rank
from rlproxy.serving.model import lora_weights
from rlproxy.settings import Settings
from rlproxy.training.examples import shards as examples_shards
from rlproxy.training.learner import (
    ForwardBackwardOutput, LearnerFailed, LocalLearner, OptimStepOutput,
)
from rlproxy.training.rank_link import Link, RankFailed, flat, reduce, unflat

log = logging.getLogger(__name__)

FLOATS = ("old", "adv", "mask", "prox")  # an example's per-position lists, sent as float32


class ShardFailed(LearnerFailed):
    """Another rank could not compute its shard: every rank dropped the step (the group is
    sound). Retried like a learner's own failure: its turns are charged only after
    LEARNER_FAILED_TRIES in a row (a worker short of memory is not the turns' fault)."""


def group():
    """The launch's group when it has more than one rank, else None."""
    if launched_rank() is None:
        return None
    g = mx.distributed.init(strict=True)
    return g if g.size() > 1 else None


def check(settings: Settings) -> None:
    """ValueError for what several ranks cannot do: every rank but 0 only trains."""
    if settings.remote.trainer == "tinker":
        raise ValueError("--trainer tinker trains elsewhere: run one process, not mlx.launch")


# ---- a shard as message arrays ----

def pack_examples(shard: list[dict]) -> tuple[list, list[np.ndarray]]:
    """Per example: its trained tokens and which lists follow; the lists."""
    heads, arrays = [], []
    for ex in shard:
        floats = [k for k in FLOATS if ex.get(k) is not None]
        heads.append({"tokens": ex["tokens"], "floats": floats})
        arrays.append(np.asarray(ex["ids"], dtype=np.int32))
        arrays += [np.asarray(ex[k], dtype=np.float32) for k in floats]
    return heads, arrays


def unpack_examples(heads: list[dict], arrays: list[np.ndarray]) -> list[dict]:
    out, it = [], iter(arrays)
    for h in heads:
        ex = {"tokens": h["tokens"], "ids": next(it).tolist()}
        for k in h["floats"]:
            ex[k] = next(it).tolist()  # float32 values: what mx.array makes of rank 0's lists
        out.append(ex)
    return out


def state_items(learner: LocalLearner) -> list[tuple[str, mx.array]]:
    """The adapter and the optimizer state, in one order on every rank."""
    return ([("adapter." + k, v) for k, v in sorted(lora_weights(learner.model).items())]
            # sorted: a loaded checkpoint's state comes in another order than a fresh one's
            + [("optimizer." + k, v) for k, v in sorted(tree_flatten(learner.optimizer.state))])


def layout(learner: LocalLearner) -> list:
    return [[k, list(v.shape)] for k, v in state_items(learner)]


def set_state(learner: LocalLearner, vector: mx.array) -> None:
    items = state_items(learner)
    values = unflat(vector, [v for _, v in items])
    adapter = {k.removeprefix("adapter."): v for (k, _), v in zip(items, values)
               if k.startswith("adapter.")}
    opt = [(k.removeprefix("optimizer."), v) for (k, _), v in zip(items, values)
           if k.startswith("optimizer.")]
    learner.restore({"adapter": adapter, "optimizer": tree_unflatten(opt)})


def number(x) -> float:
    """A figure from a message: JSON has no NaN (orjson writes null), one process would sum it."""
    return float("nan") if x is None else float(x)


def trainable(learner: LocalLearner) -> tuple[list[str], list[mx.array]]:
    """The LoRA parameters' names and arrays, in one order on every rank."""
    items = tree_flatten(learner.model.trainable_parameters())
    return [k for k, _ in items], [v for _, v in items]


def shard_gradients(learner: LocalLearner, shard: list[dict], n_tokens: int, keys: list[str],
                    between) -> tuple[list[float], list[mx.array] | None]:
    loss, kl, ent, tree = learner.gradients(shard, n_tokens, between)
    if tree is None:
        return [loss, kl, ent], None
    grads = dict(tree_flatten(tree))
    out = [grads[k] for k in keys]
    mx.eval(out)
    return [loss, kl, ent], out


class ParallelLearner(LocalLearner):
    """Rank 0's learner: a LocalLearner whose forward_backward and optim_step run on every
    rank of the launch, each rank on its shard of the batch."""

    def __init__(self, settings: Settings, model, lora_config: dict, checkpoints: Path,
                 ref_model, link: Link):
        super().__init__(settings, model, lora_config, checkpoints, ref_model)
        self.link = link
        self.synced = False  # the other ranks hold rank 0's adapter and optimizer state
        self.keys, self.like = trainable(self)
        if not mx.metal.is_available():
            # MLX's CPU allocator waits for every CPU stream before it clears its buffer cache,
            # and mlx-lm's prefill clears it: a sum a rank stalls in would stall serving. With
            # no cache there is nothing to clear, and no wait.
            mx.set_cache_limit(0)
        try:  # the others load the model meanwhile: this waits for them
            with self.link.lock:
                answers = self.link.call("meeting the other ranks", self._layout, layout(self))
        except RankFailed as e:  # serving goes on; each step says why it cannot train
            log.error("%s", e)
            return
        wrong = [rank for rank, (a, _) in answers.items() if a.get("mismatch")]
        if wrong:
            raise ValueError(f"under mlx.launch: rank(s) {wrong} loaded another model or LoRA "
                             "layout than rank 0; give every rank the same --model and LoRA "
                             "flags")

    def _layout(self, shape: list) -> dict:
        self.link.tell({"op": "layout", "layout": shape, "kl": self.ref_model is not None})
        return self.link.answers()

    def health(self) -> dict:
        return {"ranks": self.link.size, "ranks_error": self.link.broken}

    def set_weights(self, weights: dict[str, mx.array]) -> None:
        super().set_weights(weights)
        self.synced = False  # the other ranks get the state with the next batch

    def forward_backward(self, examples: list[dict],
                         between: Callable[[float], None]) -> ForwardBackwardOutput:
        with self.link.lock:
            return self._forward_backward(examples, between)

    def _forward_backward(self, examples: list[dict],
                          between: Callable[[float], None]) -> ForwardBackwardOutput:
        n_tokens = sum(e["tokens"] for e in examples)
        shards = examples_shards(examples, self.link.size, lambda e: len(e["ids"]))
        state = None
        if not self.synced:
            state = np.asarray(flat([v for _, v in state_items(self)]))
        self.link.call("sending the shards", self._send, shards, n_tokens, state)
        self.synced = True
        error = grads = None
        figures = [0.0, 0.0, 0.0]
        try:
            figures, grads = shard_gradients(self, shards[0], n_tokens, self.keys, between)
        except Exception as e:  # the others hear of it, and drop the step
            error = e
        answers = self.link.call("waiting for the other ranks' shards", self.link.answers)
        failed = [f"rank {r}: {a['error']}" for r, (a, _) in answers.items()
                  if a["op"] == "failed"]
        if error is not None or failed:
            self.link.call("dropping the step", self.link.tell, {"op": "drop"})
            if error is not None:
                raise error  # rank 0's own failure, as one process would raise it
            raise ShardFailed("the step failed on " + "; ".join(failed))
        summed = self.link.call("summing the gradients", self._sum, grads)
        self.accumulate(tree_unflatten(list(zip(self.keys, summed))))
        for head, _ in answers.values():  # loss, KL, entropy: summed here, in float64
            figures = [a + number(b) for a, b in zip(figures, head["figures"])]
        return ForwardBackwardOutput(*figures, n_tokens,
                                     [sum(len(e["ids"]) for e in s) for s in shards])

    def _send(self, shards: list[list[dict]], n_tokens: int, state) -> None:
        for rank in range(1, self.link.size):
            heads, arrays = pack_examples(shards[rank])
            self.link.tell({"op": "forward_backward", "n_tokens": n_tokens, "examples": heads,
                            "sync": state is not None},
                           arrays + ([state] if state is not None else []), to=rank)

    def _sum(self, grads):
        self.link.tell({"op": "sum"})  # every rank enters the sum now, none waits in it long
        return reduce(self.link, grads, self.like)

    def optim_step(self, learning_rate: float) -> OptimStepOutput:
        with self.link.lock:
            self.link.call("sending the step", self.link.tell,
                           {"op": "optim_step", "learning_rate": learning_rate})
        try:
            return super().optim_step(learning_rate)
        except BaseException:  # the others took the step: they get this rank's state next
            self.synced = False
            raise



def join(settings: Settings) -> Link | None:
    """Rank 0 of a launch of several ranks: its link to the others, once they called (a
    broken one if they did not: serving goes on, training says why); None outside a launch."""
    group_ = group()
    if group_ is None:
        return None
    link = Link(group_, settings.trainer.distributed_timeout_s)
    try:
        with link.lock:
            link.call("meeting the other ranks", link.accept)
    except RankFailed as e:
        log.error("%s", e)
    log.info("rank 0 of %d: the other ranks compute gradients", link.size)
    return link


def leave(link: Link) -> None:
    """Rank 0 stops: the others exit (0), then the connections close."""
    try:
        if not link.broken:
            with link.lock:
                link.call("stopping the other ranks", link.tell, {"op": "stop"})
    except RankFailed:
        pass
    link.close()


def outlive(link: Link, log_path: Path) -> str | None:
    """On SIGTERM or SIGHUP to rank 0 (api/server.py): mlx.launch sends it when another rank
    exits with an error, and then waits for rank 0 without reading its output. A broken group:
    this rank's output goes to LOG_PATH from now on, and the reason is returned (serving goes
    on); a sound one: None (the signal stops the server)."""
    reason = link.lost_rank()
    if reason is None:
        return None
    print(f"rlproxy: a rank of this launch failed ({reason}); mlx.launch asked rank 0 to stop, "
          f"but it serves on with training paused (stop it with SIGINT). Its output goes to "
          f"{log_path} from now on.", file=sys.stderr, flush=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return reason


def work(settings: Settings, link: Link) -> int:
    """A rank other than 0: meet rank 0, load the model as it does, then compute the shards it
    is sent (the trainer's, the Tinker API's) until it says stop (0) or goes away (1)."""
    from rlproxy.serving.model import load_base_model, load_serving_model
    from rlproxy.tinker import ranks as tinker_ranks
    from rlproxy.training.learner import training_copy

    t = settings.trainer
    learner = keys = like = None  # the trainer's, made when rank 0's trainer asks
    runs: dict = {}  # the Tinker API's runs this rank has weights of
    try:
        link.connect()
        loaded = load_serving_model(settings.model, lora_seed=t.train_seed)
        log.info("rank %d of %d: a gradient worker for rank 0", link.rank, link.size)
        while True:
            head, arrays = link.hear()
            op = head["op"]
            if op == "stop":
                log.info("rank %d: rank 0 stopped; exiting", link.rank)
                return 0
            if op == "layout":
                if learner is None:  # with a KL reference model where rank 0 has one
                    ref = load_base_model(settings.model)[0] if head["kl"] else None
                    learner = LocalLearner(settings, training_copy(loaded), loaded.lora_config,
                                           Path(os.devnull), ref)
                    keys, like = trainable(learner)
                link.answer({"op": "layout", "mismatch": head["layout"] != layout(learner)})
            elif op == "optim_step":
                learner.optim_step(head["learning_rate"])
            elif op == "forward_backward":
                step(link, learner, head, arrays, keys, like)
            elif op == "tinker":
                tinker_ranks.shard(link, loaded, runs, head, arrays)
            else:
                raise ValueError(f"rank {link.rank}: unknown message {op!r} from rank 0")
    except (ConnectionError, RuntimeError) as e:  # RuntimeError: MLX's, from a broken sum
        log.error("rank %d: rank 0 went away (%s); exiting", link.rank, e)
        return 1


def step(link: Link, learner: LocalLearner, head: dict, arrays: list, keys: list, like: list):
    """A worker's forward_backward: its shard's gradient, summed with the others' if rank 0
    says every rank has one."""
    if head["sync"]:
        set_state(learner, mx.array(arrays.pop()))
    grads = None
    try:
        shard = unpack_examples(head["examples"], arrays)
        figures, grads = shard_gradients(learner, shard, head["n_tokens"], keys,
                                         lambda _s: None)
        link.answer({"op": "ready", "figures": figures})
    except Exception as e:
        log.exception("rank %d: the shard failed", link.rank)
        link.answer({"op": "failed", "error": f"{type(e).__name__}: {e}"[:2000]})
    if link.hear()[0]["op"] != "sum":  # "drop": a rank failed, no one takes this step
        return
    summed = reduce(link, grads, like)
    learner.accumulate(tree_unflatten(list(zip(keys, summed))))
