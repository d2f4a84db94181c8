"""Data-parallel training over the ranks of an `mlx.launch` (mx.distributed).

`mlx.launch --hosts mac1,mac2 -- rlproxy serve …` (or `rlproxy train --from …`) runs the same
command on every rank. Rank 0 does all that one process does: HTTP, records, the trainer loop,
checkpoints. Its learner is a ParallelLearner: each forward_backward splits the batch into one
shard per rank, balanced by tokens (a packed session is one example, so it stays on one rank),
sends the other ranks theirs, computes its own, and sums gradients and loss figures over the
ranks with one `all_sum`. Every rank applies the identical AdamW update (optim_step is sent to
the others too), so the adapters stay equal without being shipped; after anything else changes
rank 0's state (a resumed checkpoint, a rollback, the eval gate's measurements) the next call
sends the whole state first. The other ranks run `work`: a gradient worker on its own copy of
the model, with no HTTP and no data dir.

Exact: every rank divides its examples' losses by the whole batch's trained tokens, and the
figures are sums, so a step equals one process's up to the order of summation.

Failure: each exchange on rank 0 runs on a thread of its own (a CPU stream: a hung exchange
holds nothing else up) and is waited for at most `distributed_timeout_s`. Past that, or on an
error (a dead peer breaks the ring at once), the group is broken for good: RankFailed, a
LearnerUnavailable, so the batch waits with no turn charged, /healthz says what failed, and
serving goes on. Training resumes when the launch is restarted.

Not here: what a step trains (training/loop.py); one sequence's gradient (chunked_grad.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import struct
import sys
import threading
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
import orjson
from mlx.utils import tree_flatten, tree_unflatten

from rlproxy.ops.ranks import launched_rank
from rlproxy.serving.mlx_threads import Worker
from rlproxy.serving.model import lora_weights
from rlproxy.settings import Settings
from rlproxy.training.learner import (
    ForwardBackwardOutput, LearnerUnavailable, LocalLearner, OptimStepOutput,
)

log = logging.getLogger(__name__)

FLOATS = ("old", "adv", "mask", "prox")  # an example's per-position lists, sent as float32
ERROR_BYTES = 512  # of each rank's message when its shard fails


class RankFailed(LearnerUnavailable):
    """An exchange with the other ranks failed or passed its deadline: the group is broken."""


class ShardFailed(RuntimeError):
    """A rank could not compute its shard: every rank dropped the step (the group is sound)."""


def group():
    """The launch's group when it has more than one rank, else None."""
    if launched_rank() is None:
        return None
    g = mx.distributed.init(strict=True)
    return g if g.size() > 1 else None


def check(settings: Settings) -> None:
    """ValueError for what several ranks cannot do: every rank but 0 only trains."""
    if not settings.trainer.train:
        raise ValueError("under mlx.launch every rank but 0 only trains: drop --no-train, or "
                         "run one process")
    if settings.remote.trainer == "tinker":
        raise ValueError("--trainer tinker trains elsewhere: run one process, not mlx.launch")


def split(examples: list[dict], ranks: int) -> list[list[dict]]:
    """EXAMPLES in RANKS shards of about equal tokens: longest first, each to the lightest
    shard (the lowest rank on a tie), keeping batch order within a shard."""
    load, owner = [0] * ranks, {}
    for i in sorted(range(len(examples)), key=lambda i: -len(examples[i]["ids"])):
        r = min(range(ranks), key=lambda r: load[r])
        owner[i] = r
        load[r] += len(examples[i]["ids"])
    return [[ex for i, ex in enumerate(examples) if owner[i] == r] for r in range(ranks)]


# ---- messages: a JSON head and arrays, as one byte string ----

def pack(head: dict, arrays: list[np.ndarray] = ()) -> bytes:
    arrays = [np.ascontiguousarray(a) for a in arrays]
    meta = orjson.dumps({**head, "arrays": [[a.dtype.str, a.size] for a in arrays]})
    return struct.pack("<Q", len(meta)) + meta + b"".join(a.tobytes() for a in arrays)


def unpack(data: bytes) -> tuple[dict, list[np.ndarray]]:
    (n,) = struct.unpack_from("<Q", data)
    head = orjson.loads(data[8:8 + n])
    at, arrays = 8 + n, []
    for dtype, size in head.pop("arrays"):
        a = np.frombuffer(data, dtype=np.dtype(dtype), count=size, offset=at)
        arrays.append(a)
        at += a.nbytes
    return head, arrays


def pack_examples(shards: list[list[dict]]) -> tuple[list, list[np.ndarray]]:
    """Per shard, per example: its trained tokens and which lists follow; the lists."""
    heads, arrays = [], []
    for shard in shards:
        heads.append([])
        for ex in shard:
            floats = [k for k in FLOATS if ex.get(k) is not None]
            heads[-1].append({"tokens": ex["tokens"], "floats": floats})
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


# ---- flat float32 vectors of a tree's arrays ----

def flat(arrays: list[mx.array]) -> mx.array:
    return mx.concatenate([a.astype(mx.float32).reshape(-1) for a in arrays])


def unflat(vector: mx.array, like: list[mx.array]) -> list[mx.array]:
    out, at = [], 0
    for a in like:
        out.append(vector[at:at + a.size].reshape(a.shape).astype(a.dtype))
        at += a.size
    return out


def state_items(learner: LocalLearner) -> list[tuple[str, mx.array]]:
    """The adapter and the optimizer state, in one order on every rank."""
    return ([("adapter." + k, v) for k, v in sorted(lora_weights(learner.model).items())]
            + [("optimizer." + k, v) for k, v in tree_flatten(learner.optimizer.state)])


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


class Link:
    """The exchanges of one rank with the others, all as sums over the ranks (rank 0 sends by
    adding what the others add zeros to). Rank 0's run on a Worker thread with a deadline."""

    def __init__(self, group, timeout_s: float | None):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.timeout_s = timeout_s
        self.broken: str | None = None
        self.reduced_bytes = 0  # all_sum payload since the start (bench/distributed.py)
        self._worker = Worker("rlproxy-ranks", mx.cpu) if timeout_s else None
        # the sums run on the CPU (the ring's), on that thread's own stream, else this one's
        self._stream = None if self._worker is not None else mx.cpu

    def call(self, what: str, fn: Callable, *args, timeout_s: float | None = None):
        """FN(*ARGS) on the exchange thread, waited for at most TIMEOUT_S (default: the link's)
        on rank 0; on a worker, here."""
        if self.broken:
            raise RankFailed(self.broken)
        if self._worker is None:
            return fn(*args)
        fut = self._worker.run(fn, *args)
        wait = timeout_s or self.timeout_s
        try:
            return fut.result(timeout=wait)
        except ShardFailed:
            raise
        except concurrent.futures.TimeoutError:
            self.broken = (f"{what}: the other ranks did not answer within {wait:g} s "
                           "(--distributed-timeout-s): a rank hangs or died")
        except Exception as e:
            self.broken = f"{what}: {type(e).__name__}: {e} (a rank died or left the ring)"
        log.error("training across ranks stopped: %s", self.broken)
        raise RankFailed(f"{self.broken}; training waits until the launch is restarted, "
                         "serving goes on")

    def all_sum(self, x: mx.array) -> mx.array:
        self.reduced_bytes += x.nbytes
        y = mx.distributed.all_sum(x, group=self.group, stream=self._stream)
        mx.eval(y)
        return y

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's DATA on every rank (the others pass None)."""
        n = int(self.all_sum(mx.array([len(data) if data else 0], dtype=mx.int64)).item())
        buf = (np.frombuffer(data, dtype=np.uint8) if self.rank == 0
               else np.zeros(n, dtype=np.uint8))
        return bytes(np.asarray(self.all_sum(mx.array(buf))))

    def tell(self, head: dict, arrays: list[np.ndarray] = ()) -> None:
        data = pack(head, arrays)
        self.call(head["op"], self.broadcast_bytes, data)

    def hear(self) -> tuple[dict, list[np.ndarray]]:
        return unpack(self.broadcast_bytes(None))

    def close(self) -> None:
        if self._worker is not None:  # a hung exchange keeps its (daemon) thread
            self._worker.stop(wait_s=0 if self.broken else 5)


def reduce(link: Link, grads: list[mx.array] | None, like: list[mx.array],
           figures: list[float], error: str | None):
    """Sum gradients (zeros for an empty shard), FIGURES and failures over the ranks. The
    summed (gradient arrays, figures), or RuntimeError naming each rank that failed."""
    parts = grads if grads is not None else [mx.zeros(a.shape, a.dtype) for a in like]
    total = link.all_sum(mx.concatenate([flat(parts), mx.array(figures + [float(bool(error))])]))
    if total[-1].item() > 0:  # every rank hears every failure, and takes no gradient
        row = np.zeros((link.size, ERROR_BYTES), dtype=np.uint8)
        text = (error or "").encode()[:ERROR_BYTES]
        row[link.rank, :len(text)] = np.frombuffer(text, dtype=np.uint8)
        rows = np.array(link.all_sum(mx.array(row)))
        said = [f"rank {r}: {bytes(rows[r]).rstrip(bytes(1)).decode(errors='replace')}"
                for r in range(link.size) if rows[r].any()]
        raise ShardFailed("the step failed on " + "; ".join(said))
    n = len(figures)
    grads = unflat(total[:-1 - n], like)
    mx.eval(grads)  # here: a lazy array holds this thread's stream
    return grads, total[-1 - n:-1].tolist()


class ParallelLearner(LocalLearner):
    """Rank 0's learner: a LocalLearner whose forward_backward and optim_step run on every
    rank of the launch, each rank on its shard of the batch."""

    def __init__(self, settings: Settings, model, lora_config: dict, checkpoints: Path,
                 ref_model, link: Link):
        super().__init__(settings, model, lora_config, checkpoints, ref_model)
        self.link = link
        self.synced = False  # the other ranks hold rank 0's adapter and optimizer state
        # held from a call's first exchange to its last (a ping between them would be heard
        # by ranks waiting for the sum)
        self.exchanging = threading.Lock()
        self.keys = [k for k, _ in tree_flatten(model.trainable_parameters())]
        if not mx.metal.is_available():
            # MLX's CPU allocator waits for every CPU stream before it clears its buffer cache,
            # and mlx-lm's prefill clears it: an exchange a stalled rank leaves pending would
            # stall serving. With no cache there is nothing to clear, and no wait.
            mx.set_cache_limit(0)
        try:  # the others are loading the model meanwhile: this waits for them
            mismatch = self.link.call("hello", self._hello, layout(self))
        except RankFailed as e:  # serving goes on; each step says why it cannot train
            log.error("%s", e)
            return
        if mismatch:
            raise ValueError(f"under mlx.launch: {mismatch} rank(s) loaded another model or LoRA "
                             "layout than rank 0; give every rank the same --model and LoRA "
                             "flags")

    def _hello(self, shape: list) -> int:
        self.link.broadcast_bytes(pack({"op": "hello", "layout": shape}))
        return int(self.link.all_sum(mx.array([0], dtype=mx.int32)).item())

    def health(self) -> dict:
        return {"ranks": self.link.size, "ranks_error": self.link.broken}

    def set_weights(self, weights: dict[str, mx.array]) -> None:
        super().set_weights(weights)
        self.synced = False  # the other ranks get the state with the next batch

    def forward_backward(self, examples: list[dict],
                         between: Callable[[float], None]) -> ForwardBackwardOutput:
        with self.exchanging:
            return self._forward_backward(examples, between)

    def _forward_backward(self, examples: list[dict],
                          between: Callable[[float], None]) -> ForwardBackwardOutput:
        n_tokens = sum(e["tokens"] for e in examples)
        shards = split(examples, self.link.size)
        heads, arrays = pack_examples(shards[1:])
        head = {"op": "forward_backward", "n_tokens": n_tokens, "shards": heads,
                "sync": not self.synced}
        state = None
        if not self.synced:  # evaluated here: a lazy array holds this thread's stream
            state = flat([v for _, v in state_items(self)])
            mx.eval(state)
        self.link.call("sending the shards", self._send, head, arrays, state)
        self.synced = True
        like = [dict(tree_flatten(self.model.trainable_parameters()))[k] for k in self.keys]
        error = grads = None
        figures = [0.0, 0.0, 0.0]
        try:
            loss, kl, ent, tree = self.gradients(shards[0], n_tokens, between)
            figures = [loss, kl, ent]
            if tree is not None:
                grads = [dict(tree_flatten(tree))[k] for k in self.keys]
                mx.eval(grads)
        except Exception as e:  # the others wait in the sum: they hear of it there
            error = e
        try:
            summed, figures = self.link.call("summing the gradients", reduce, self.link, grads,
                                             like, figures, error and f"{type(error).__name__}: "
                                             f"{error}")
        except ShardFailed:
            if error is not None:
                raise error  # rank 0's own failure, as one process would raise it
            raise
        self.accumulate(tree_unflatten(list(zip(self.keys, summed))))
        return ForwardBackwardOutput(*figures, n_tokens,
                                     [sum(len(e["ids"]) for e in s) for s in shards])

    def _send(self, head: dict, arrays: list, state: mx.array | None) -> None:
        self.link.broadcast_bytes(pack(head, arrays))
        if state is not None:
            self.link.all_sum(state)

    def optim_step(self, learning_rate: float) -> OptimStepOutput:
        with self.exchanging:
            self.link.tell({"op": "optim_step", "learning_rate": learning_rate})
        try:
            return super().optim_step(learning_rate)
        except BaseException:  # the others took the step: they get this rank's state next
            self.synced = False
            raise

    def lost_rank(self, wait_s: float = 10.0) -> str | None:
        """Why the group is broken, or None: known, or found by a ping once no call holds the
        exchanges (a call in progress fails fast on a dead rank)."""
        with self.exchanging:
            if not self.link.broken:
                try:
                    self.link.call("ping", self.link.broadcast_bytes, pack({"op": "ping"}),
                                   timeout_s=wait_s)
                except RankFailed:
                    pass
        return self.link.broken

    def close(self) -> None:
        with self.exchanging:
            try:
                if not self.link.broken:
                    self.link.tell({"op": "stop"})
            except RankFailed:
                pass
            self.link.close()


def outlive(learner: ParallelLearner, log_path: Path) -> str | None:
    """On SIGTERM or SIGHUP to rank 0 (api/server.py): mlx.launch sends it when another rank
    exits with an error, and then waits for rank 0 without reading its output. A broken group:
    this rank's output goes to LOG_PATH from now on, and the reason is returned (serving goes
    on); a sound one: None (the signal stops the server)."""
    reason = learner.lost_rank()
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
    """A rank other than 0: load the model as rank 0 does, then compute the shards it is sent
    until it is told to stop."""
    from rlproxy.serving.model import load_base_model, load_serving_model
    from rlproxy.training.learner import training_copy

    t = settings.trainer
    loaded = load_serving_model(settings.model, lora_seed=t.train_seed)
    ref = load_base_model(settings.model)[0] if t.kl_coef > 0 else None
    learner = LocalLearner(settings, training_copy(loaded), loaded.lora_config, Path(os.devnull),
                           ref)
    keys = [k for k, _ in tree_flatten(learner.model.trainable_parameters())]
    like = [dict(tree_flatten(learner.model.trainable_parameters()))[k] for k in keys]
    log.info("rank %d of %d: a gradient worker for rank 0", link.rank, link.size)
    while True:
        head, arrays = link.hear()
        op = head["op"]
        if op == "stop":
            log.info("rank %d: rank 0 stopped training; exiting", link.rank)
            return 0
        if op == "ping":
            continue
        if op == "hello":
            link.all_sum(mx.array([int(head["layout"] != layout(learner))], dtype=mx.int32))
        elif op == "optim_step":
            learner.optim_step(head["learning_rate"])
        elif op == "forward_backward":
            if head["sync"]:
                set_state(learner, link.all_sum(mx.zeros_like(flat(
                    [v for _, v in state_items(learner)]))))
            error, grads, figures = None, None, [0.0, 0.0, 0.0]
            try:
                shard = unpack_examples(head["shards"][link.rank - 1], arrays[sum(
                    1 + len(h["floats"]) for s in head["shards"][:link.rank - 1] for h in s):])
                loss, kl, ent, tree = learner.gradients(shard, head["n_tokens"], lambda _s: None)
                figures = [loss, kl, ent]
                if tree is not None:
                    grads = [dict(tree_flatten(tree))[k] for k in keys]
                    mx.eval(grads)
            except Exception as e:
                log.exception("rank %d: the shard failed", link.rank)
                error = f"{type(e).__name__}: {e}"
            try:
                summed, _ = reduce(link, grads, like, figures, error)
            except ShardFailed as e:
                log.error("rank %d: step abandoned: %s", link.rank, e)
                continue
            learner.accumulate(tree_unflatten(list(zip(keys, summed))))
        else:
            raise ValueError(f"rank {link.rank}: unknown message {op!r} from rank 0")
