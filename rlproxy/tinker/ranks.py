"""The Tinker API's forward_backward on every rank of an mlx.launch (training/distributed.py).

Rank 0 (the server) splits a batch's datums into one shard per rank, balanced by tokens, and
sends each other rank its shard with the run's LoRA layout and, when that rank has not seen this
state of the run yet, its weights (the optimizer stays on rank 0: AdamW steps there and the next
batch carries the new weights). Every rank computes its shard's loss, log-probs and gradient
with `models.value_grads`; the log-probs come back in the datums' order and the gradients are
summed over the ranks. So `forward_backward` and `optim_step` answer as in one process, up to
the order of summation. The exchanges are training/rank_link.py's: past the deadline, or when a
rank is gone, the call fails (RankFailed) and the link stays broken until the launch restarts.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from rlproxy.serving.model import lora_weights
from rlproxy.tinker import models
from rlproxy.training import losses
from rlproxy.training.examples import shards
from rlproxy.training.rank_link import Link, reduce

log = logging.getLogger(__name__)

PER_DATUM = ("ids", "targets", "old", "adv", "mask")  # each an array of one row
KEEP_RUNS = 16  # runs a rank keeps a model of (the rest are made again when asked)


def value_grads(link: Link, run: models.Run, batch: tuple, backward: bool):
    """`models.value_grads` of BATCH at RUN's weights, computed on every rank."""
    examples, fn, kw, name = batch
    parts = shards(list(range(len(examples))), link.size, lambda i: examples[i]["ids"].shape[1])
    rows = [[np.asarray(examples[i][k][0]) for i in part for k in PER_DATUM] for part in parts]
    weights = sorted(lora_weights(run.model).items())
    keys, like = zip(*tree_flatten(run.model.trainable_parameters())) if backward else ((), ())
    with link.lock:
        for attempt in (1, 2):  # a rank that dropped the run's weights gets them again
            link.call("sending the Tinker shards", send, link, run, parts, rows, weights, name,
                      kw, backward)
            error = None
            try:
                total, outputs, grads = models.value_grads(
                    run.model, ([examples[i] for i in parts[0]], fn, kw, name), backward)
            except Exception as e:  # the others hear of it, and drop the batch
                error, total, outputs, grads = e, 0.0, [], None
            answers = link.call("waiting for the other ranks' Tinker shards", link.answers)
            stale = [r for r, (a, _) in answers.items() if a["op"] == "stale"]
            failed = [f"rank {r}: {a['error']}" for r, (a, _) in answers.items()
                      if a["op"] == "failed"]
            if error is None and not failed and not stale:
                break
            link.call("dropping the batch", link.tell, {"op": "drop"})
            if error is not None:
                raise error
            if failed or attempt == 2:
                raise RuntimeError("the batch failed on " + "; ".join(
                    failed or [f"rank {r}: no weights of run {run.name}" for r in stale]))
            for r in stale:
                link.tinker_seen.pop((r, run.name), None)
        if backward:
            flat_grads = None if grads is None else [dict(tree_flatten(grads))[k] for k in keys]
            summed = link.call("summing the Tinker gradients", sum_now, link, flat_grads,
                               list(like))
            grads = tree_unflatten(list(zip(keys, summed)))
        else:
            link.call("ending the forward pass", link.tell, {"op": "done"})
    logprobs = [None] * len(examples)
    for i, out in zip(parts[0], outputs):
        logprobs[i] = out
    for rank, (head, arrays) in answers.items():
        total += float("nan") if head["loss"] is None else head["loss"]  # NaN: JSON null
        for i, out in zip(parts[rank], arrays):
            logprobs[i] = np.array(out, dtype=np.float32)
    return total, logprobs, grads


def send(link: Link, run, parts, rows, weights, name, kw, backward) -> None:
    """Each other rank's shard, with RUN's weights where that rank has not seen this state."""
    seen = link.tinker_seen
    for rank in range(1, link.size):
        fresh = seen.get((rank, run.name)) != (run.uid, run.version)
        head = {"op": "tinker", "run": run.name, "config": run.lora_config, "loss_fn": name,
                "kwargs": kw, "backward": backward, "n": len(parts[rank]), "weights": fresh,
                "state": [run.uid, run.version],
                "keys": [k for k, _ in weights] if fresh else [],
                "shapes": [list(v.shape) for _, v in weights] if fresh else []}
        arrays = [np.asarray(v.astype(mx.float32)) for _, v in weights] if fresh else []
        link.tell(head, arrays + rows[rank], to=rank)
        seen[(rank, run.name)] = (run.uid, run.version)


def sum_now(link: Link, grads, like):
    link.tell({"op": "sum"})  # every rank enters the sum now
    return reduce(link, grads, like)


def shard(link: Link, loaded, runs: dict, head: dict, arrays: list) -> None:
    """A rank other than 0: its shard of a Tinker batch (RUNS: the runs it has models of).
    A run it dropped (past KEEP_RUNS) and is not sent the weights of again is `stale`: rank 0
    sends them then."""
    grads = model = None
    try:
        entry = runs.get(head["run"])
        if entry is None or entry["config"] != head["config"]:
            if len(runs) >= KEEP_RUNS:
                runs.pop(next(iter(runs)))
            entry = runs[head["run"]] = {"config": head["config"], "state": None,
                                         "model": models.lora_model(loaded, head["config"])}
        model, it = entry["model"], iter(arrays)
        if head["weights"]:
            current = dict(tree_flatten(model.parameters()))
            model.update(tree_unflatten([
                (k, mx.array(next(it)).reshape(shape).astype(current[k].dtype))
                for k, shape in zip(head["keys"], head["shapes"])]))
            entry["state"] = head["state"]
        if entry["state"] != head["state"]:
            link.answer({"op": "stale"})
        else:
            examples = [{k: mx.array(next(it))[None] for k in PER_DATUM}
                        for _ in range(head["n"])]
            fn = losses.policy_loss(head["loss_fn"])
            total, outputs, grads = models.value_grads(
                model, (examples, fn, head["kwargs"], head["loss_fn"]), head["backward"])
            link.answer({"op": "ready", "loss": total}, outputs)
    except Exception as e:
        log.exception("rank %d: the Tinker shard failed", link.rank)
        link.answer({"op": "failed", "error": f"{type(e).__name__}: {e}"[:2000]})
    if link.hear()[0]["op"] != "sum":  # "done" (forward only) or "drop"
        return
    keys, like = zip(*tree_flatten(model.trainable_parameters()))
    flat_grads = None if grads is None else [dict(tree_flatten(grads))[k] for k in keys]
    reduce(link, flat_grads, list(like))
