"""How the ranks of an mlx.launch talk: messages over TCP, sums over mx.distributed.

Messages (a JSON head and arrays as one byte string: `pack`) go between rank 0 and each other
rank over a TCP connection of their own. A rank waiting for work blocks in `recv`: a pending MLX
collective would spin a core the whole time, and on the CPU backend it holds up MLX's buffer
cache (clear_cache waits for every CPU stream). The only collectives are the port rank 0 listens
on (once, at start) and the gradient sums, entered by every rank together, right after rank 0
has heard that each is ready.

Rank 0's side runs every exchange on a thread of its own (an MLX Worker on a CPU stream) and
waits for it at most `timeout_s`; past that, or on an error (a rank that exits closes its
connection at once), the link is broken for good (a group whose exchange failed is never used
again: MLX would hang in it): RankFailed, and /healthz says why.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import select
import socket
import struct
import threading
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np
import orjson

from rlproxy.mlx_threads import Worker
from rlproxy.training.learner import LearnerUnavailable

log = logging.getLogger(__name__)


class RankFailed(LearnerUnavailable):
    """An exchange with the other ranks failed or passed its deadline: the group is broken."""


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


def rank0_host() -> str:
    """Rank 0's address as the launch gave it: JACCL's coordinator, or the ring's hostfile
    (else this machine: MPI on one machine)."""
    address = None
    if coordinator := os.environ.get("MLX_JACCL_COORDINATOR"):
        address = coordinator
    elif hostfile := os.environ.get("MLX_HOSTFILE"):
        address = str(json.loads(Path(hostfile).read_text())[0][0])
    return address.rsplit(":", 1)[0].strip("[]") if address else "127.0.0.1"


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("<Q", len(data)) + data)


def recv_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = sock.recv(min(n - len(buf), 1 << 20))
            if not part:
                raise ConnectionError("the connection closed (the other rank exited)")
            buf += part
        return bytes(buf)

    (n,) = struct.unpack("<Q", exactly(8))
    return exactly(n)


class Link:
    """One rank's connections: rank 0's to each other rank, or another rank's to rank 0."""

    def __init__(self, group, timeout_s: float | None):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self.timeout_s = timeout_s  # rank 0's deadline per exchange (None: wait, a worker)
        self.broken: str | None = None
        self.reduced_bytes = 0  # all_sum payload since the start (bench/distributed.py)
        self.sent_bytes = 0  # messages rank 0 sent
        self.peers: dict[int, socket.socket] = {}  # rank 0: each other rank's connection
        # held by rank 0 from a conversation's first message to its last (the trainer's and
        # the Tinker API's steps share the ranks)
        self.lock = threading.Lock()
        self.tinker_seen: dict = {}  # rank 0: (rank, run name) -> the run state it holds
        self._worker = Worker("rlproxy-ranks", mx.cpu) if self.rank == 0 else None
        # the sums run on the CPU (the ring's): that thread's own stream, else this one's
        self._stream = None if self._worker is not None else mx.cpu

    # ---- rank 0 ----

    def call(self, what: str, fn: Callable, *args, timeout_s: float | None = None):
        """FN(*ARGS) on the exchange thread, waited for at most TIMEOUT_S (default: the
        link's); RankFailed (and the link broken for good) on an error or past the deadline.
        On another rank: here."""
        if self.broken:
            raise self.failure()
        if self._worker is None:
            return fn(*args)
        fut = self._worker.run(fn, *args)
        wait = timeout_s or self.timeout_s
        try:
            return fut.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            self.broken = (f"{what}: the other ranks did not answer within {wait:g} s "
                           "(--distributed-timeout-s): a rank hangs or died")
        except Exception as e:
            self.broken = f"{what}: {type(e).__name__}: {e} (a rank died or left the launch)"
        log.error("training across ranks stopped: %s", self.broken)
        raise self.failure()

    def failure(self) -> RankFailed:
        return RankFailed(f"{self.broken}; training waits until the launch is restarted, "
                          "serving goes on")

    def accept(self) -> None:
        """Rank 0: listen on a free port of its launch address, tell it to the others (a sum),
        take their calls (then it listens no more)."""
        try:
            listener = socket.create_server((rank0_host(), 0))
        except OSError:
            self.all_sum(mx.array([0], dtype=mx.int64))  # port 0: the others give up too
            raise
        with listener:
            port = listener.getsockname()[1]
            self.all_sum(mx.array([port], dtype=mx.int64))
            listener.settimeout(self.timeout_s)
            while len(self.peers) < self.size - 1:
                conn, _ = listener.accept()
                conn.settimeout(self.timeout_s)
                try:
                    (rank,) = struct.unpack("<I", recv_frame(conn))
                except (OSError, struct.error):
                    rank = -1
                if not 0 < rank < self.size or rank in self.peers:  # not one of the ranks
                    conn.close()
                    continue
                self.peers[rank] = conn

    def tell(self, head: dict, arrays: list[np.ndarray] = (), to: int | None = None) -> None:
        """Send a message to rank TO (default: every other rank)."""
        data = pack(head, arrays)
        for rank, sock in self.peers.items():
            if to is None or rank == to:
                send_frame(sock, data)
                self.sent_bytes += len(data)

    def answers(self) -> dict[int, tuple[dict, list[np.ndarray]]]:
        """Each other rank's next message."""
        return {rank: unpack(recv_frame(sock)) for rank, sock in sorted(self.peers.items())}

    def lost_rank(self) -> str | None:
        """Why the group is broken, or None; a rank that exited has closed its connection
        (checked without reading: a message waiting stays for the exchange thread)."""
        for rank, sock in self.peers.items():
            if self.broken:
                break
            try:
                if not select.select([sock], [], [], 0)[0]:
                    continue  # nothing to read: the rank is there (or hangs: not this check's)
                if sock.recv(1, socket.MSG_PEEK) == b"":
                    self.broken = f"rank {rank} exited (its connection closed)"
            except OSError as e:
                self.broken = f"rank {rank}: {e}"
        return self.broken

    # ---- another rank ----

    def connect(self) -> None:
        """Learn rank 0's port (a sum), call it, and say which rank this is."""
        port = int(self.all_sum(mx.array([0], dtype=mx.int64)).item())
        if port == 0:
            raise ConnectionError(f"rank 0 could not listen on {rank0_host()}")
        self.to_rank0 = socket.create_connection((rank0_host(), port))
        send_frame(self.to_rank0, struct.pack("<I", self.rank))

    def hear(self) -> tuple[dict, list[np.ndarray]]:
        return unpack(recv_frame(self.to_rank0))

    def answer(self, head: dict, arrays: list[np.ndarray] = ()) -> None:
        send_frame(self.to_rank0, pack(head, arrays))

    # ---- every rank ----

    def all_sum(self, x: mx.array) -> mx.array:
        self.reduced_bytes += x.nbytes
        y = mx.distributed.all_sum(x, group=self.group, stream=self._stream)
        mx.eval(y)
        return y

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        if self._worker is not None:  # a hung exchange keeps its (daemon) thread
            self._worker.stop(wait_s=0 if self.broken else 5)


# ---- flat float32 vectors of a tree's arrays ----

def flat(arrays: list[mx.array]) -> mx.array:
    return mx.concatenate([a.astype(mx.float32).reshape(-1) for a in arrays])


def unflat(vector: mx.array, like: list[mx.array]) -> list[mx.array]:
    out, at = [], 0
    for a in like:
        out.append(vector[at:at + a.size].reshape(a.shape).astype(a.dtype))
        at += a.size
    return out


def reduce(link: Link, grads: list[mx.array] | None, like: list[mx.array]) -> list[mx.array]:
    """Sum gradients over the ranks (zeros for an empty shard). The loss figures travel in
    messages instead: summed on rank 0 in float64, as one process sums them."""
    parts = grads if grads is not None else [mx.zeros(a.shape, a.dtype) for a in like]
    summed = unflat(link.all_sum(flat(parts)), like)
    mx.eval(summed)  # here: a lazy array holds this thread's stream
    return summed
