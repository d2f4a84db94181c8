"""The prefix KV store: prompt KV state kept in memory and on disk, found by longest prefix.

Owns the entries, the memory tier, a `diskcache` directory (`<data_dir>/prefix_cache/`), one
writer thread and its counters (`PrefixCacheStats`; `health()` is what /healthz shows). Does not
own the model or the decode loop: serving/engine.py decides when to store, serving/prefill.py's
loader thread looks up. How it works, with blobs.py (keys, hashes, bytes), index.py and
lineage.py (`--kv-reuse-max-lag`), is told once, in kv/__init__.py. It is only a cache: a damaged
cache.db is set aside as `prefix_cache.corrupt-<time>` and a new, empty store opened; one that
cannot be opened for another reason (a full disk, no permission: kv/disk.py) is kept, and
the server serves without a prefix cache (a WARNING, /healthz says why); a write the disk refuses
is one WARNING, not kept.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, LRUPromptCache

from rlproxy.kv.blobs import (
    FORMAT, LIVE_KV, CorruptEntry, Entry, block_hashes, check_quantizable, common_prefix,
    default_group_size, digest, end_hash, fresh_kv, model_key, pack, to_caches, unpack,
    unstorable,
)
from rlproxy.kv.disk import open_disk
from rlproxy.kv.index import BlockIndex
from rlproxy.kv.lineage import Lineage, lineage_file
from rlproxy.mlx_threads import mlx_thread
from rlproxy.settings import CacheSettings
from rlproxy.stores import StoreUnavailable

log = logging.getLogger("rlproxy.prefix_cache")

MAX_ENDS = 32  # turn boundaries remembered per entry
MAX_PENDING = 8  # queued writes hold KV arrays in memory; past this a write is dropped
CANDIDATES = 3  # entries tried per lookup when the best ones turn out corrupt or gone


@dataclass
class PrefixCacheStats:
    """Counted under the store's small lock; /healthz shows them under "prefix_cache"."""

    lookups: int = 0
    hits: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    cached_tokens: int = 0  # prompt tokens restored instead of prefilled
    hits_stale: int = 0  # hits on KV of an adapter before the one served
    cached_tokens_stale: int = 0
    stores: int = 0
    dropped_writes: int = 0  # the write queue was full
    not_stored_stale: int = 0  # its adapter had left the reuse window
    corrupt: int = 0
    evicted_stale: int = 0
    evicted_budget: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    errors: int = 0


class PrefixCache:
    """Thread use: `set_adapter` and `put` on the engine thread, `fetch` on the loader thread,
    `health` anywhere; everything that writes runs on the store's own writer thread."""

    def __init__(self, directory: str | Path, settings: CacheSettings, model_identity: str,
                 unsupported: str | None = None):
        self.directory = Path(directory)
        self.block = settings.prefix_block_tokens
        self.quant = ([settings.kv_group_size or 64, settings.kv_bits] if settings.kv_bits
                      else None)
        self.quantized_kv_start = settings.quantized_kv_start
        start = self.quantized_kv_start if self.quant else 0
        kv = json.dumps({"quant": self.quant, "start": start})
        self.base = digest(model_identity.encode(), kv.encode(), person=b"base")
        self.unsupported = unsupported
        self.disk_limit = int(settings.prefix_cache_disk_limit_gb * 1024**3)
        self.memory_limit = int(settings.prefix_cache_memory_mb * 1024**2)
        self.max_lag = settings.kv_reuse_max_lag
        self._lineage = Lineage(self.directory, self.base, self.max_lag)
        # personal adapters' lineages (serving/personal.py), by the engine's name for each:
        # each its own base, so its entries, windows and evictions are its own
        self._lineages: dict[str, Lineage] = {}
        self._lock = threading.Lock()  # index and memory tier: lookups and the writer
        self._small = threading.Lock()  # counters and queued writes: never held for long
        self._memory = LRUPromptCache(max_size=1 << 30, max_bytes=self.memory_limit)
        self._pending: dict[int, tuple[str, int, np.ndarray, list]] = {}  # queued writes
        self._write_ids = itertools.count()
        self.stats = PrefixCacheStats()
        try:
            self._disk, self._index = open_disk(self.directory, self.disk_limit, self.block)
        except StoreUnavailable as e:  # intact, kept: serve on without it (only a cache)
            log.warning("%s; serving without the prefix cache", e)
            self.unsupported, self._disk, self._index = f"off: {e}", None, BlockIndex(self.block)
        self._disk_bytes = self._disk.volume() if self._disk is not None else 0
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="rlproxy-prefix-writer",
                                        daemon=True)
        self._writer.start()

    def lineage(self, adapter: str | None = None) -> Lineage:
        """The live adapter's lineage, or the personal adapter ADAPTER's (made at its first
        `set_adapter`; until then, one that serves nothing: lookups miss, nothing is stored)."""
        if adapter is None:
            return self._lineage
        found = self._lineages.get(adapter)
        if found is None:
            base = digest(self.base.encode(), adapter.encode(), person=b"personal")
            found = Lineage(self.directory, base, self.max_lag, lineage_file(adapter))
        return found

    def served(self, adapter: str | None = None) -> tuple[int, str | None]:
        """(version, namespace) of the adapter served now."""
        return self.lineage(adapter).served[:2]

    def window(self, adapter: str | None = None) -> list[tuple[int, str]]:
        """The (version, namespace) pairs whose KV may be reused now, newest first."""
        return self.lineage(adapter).served[2]

    # ---- engine thread ----

    def set_adapter(self, version: int, fingerprint: str, adapter: str | None = None) -> None:
        """The engine now serves this adapter (the live one, or the personal adapter ADAPTER):
        look up under it and the N before it."""
        if adapter is not None and adapter not in self._lineages:
            self._lineages[adapter] = self.lineage(adapter)
        self.lineage(adapter).set_adapter(version, fingerprint)
        if self._disk is not None:
            self._queue.put(("stale", version, adapter))

    def reset_lineage(self, version: int, adapter: str | None = None) -> None:
        """VERSION, about to be published, is not a training step from the adapter served now
        (a rollback to an old checkpoint): KV from the versions before it must not be reused
        under it. Any thread; call it before publishing."""
        if adapter is not None and adapter not in self._lineages:
            self._lineages[adapter] = self.lineage(adapter)
        self.lineage(adapter).reset(version)

    def put(self, tokens: list[int], cache: list, ends: list[int],
            source: tuple[int, str], adapter: str | None = None) -> None:
        """Queue a finished request's KV (covering exactly `tokens`) for storing under `source`,
        the oldest adapter that computed any of it (from `fetch`); `ends` are its turn
        boundaries (prompt end, completion end). KV older than the window is not stored.
        ADAPTER: the personal adapter whose lineage it belongs to (None: the live one's)."""
        lineage = self.lineage(adapter)
        if self.unsupported or lineage.served[1] is None or len(tokens) < 2:
            return
        if source not in lineage.served[2]:  # an adapter swap outran it by more than N versions
            self._count(not_stored_stale=1)
            return
        if self._queue.qsize() >= MAX_PENDING:
            self._count(dropped_writes=1)
            return
        n = len(tokens)
        if any(c.offset != n for c in cache):
            log.warning("KV length %s != %d tokens: not stored", [c.offset for c in cache], n)
            self._count(errors=1)
            return
        arrays = []
        for c in cache:
            for a in (c.keys, c.values):
                arrays.append(a if a.shape[2] == n else mx.contiguous(a[..., :n, :]))
        mx.eval(arrays)  # here, on the thread that built them; the writer only reads them
        write_id, tokens = next(self._write_ids), np.asarray(tokens, np.int32)
        version, ns = source
        with self._small:
            self._pending[write_id] = (ns, version, tokens, arrays)
        self._queue.put(("put", write_id, ns, version, tokens, arrays, ends, lineage.base))

    # ---- loader thread ----

    def fetch(self, prompt: list[int], adapter: str | None = None
              ) -> tuple[list[KVCache] | None, int, tuple[int, str]]:
        """(a fresh cache holding the longest stored prefix of prompt, its length, source):
        source is (version, namespace) of the adapter that computed that KV, or of the one
        served on a miss; hand it back to `put`. At least one prompt token is left to prefill.
        Among the window's versions the longest prefix wins, the newest on a tie. The arrays
        are lazy: evaluate them on the calling thread. ADAPTER: a personal adapter's lineage
        (None: the live adapter's)."""
        version, ns, window = self.lineage(adapter).served
        if self.unsupported or ns is None or len(prompt) < 2:
            return None, 0, (version, ns)
        try:
            return self._fetch(np.asarray(prompt, dtype=np.int32), window)
        except Exception:  # a bug here costs speed, never the request
            log.exception("prefix cache lookup failed")
            self._count(errors=1, misses=1)
            return None, 0, (version, ns)

    def _fetch(self, prompt: np.ndarray, window: list):
        hashes = {ns: block_hashes(ns, prompt, self.block) for _, ns in window}
        with self._lock:
            ranked = sorted(((score, version, seq, key, ns) for version, ns in window
                             for score, seq, key in self._index.rank(ns, prompt, hashes[ns])),
                            reverse=True)  # longest first, then newest version, then recency
        with self._small:
            self.stats.lookups += 1
            queued = [(common_prefix(t, prompt), version, q_ns, t, arrays)
                      for q_ns, version, t, arrays in self._pending.values()
                      if (version, q_ns) in window]
        best = max(queued, key=lambda q: q[:2], default=None)
        if best is not None and best[0] >= 1 and best[:2] >= (ranked[0][:2] if ranked else (0,)):
            n, version, ns, tokens, arrays = min(best[0], len(prompt) - 1), *best[1:]
            if n >= 1:
                self._count_hit(n, version, window, memory_hits=1)
                return fresh_kv(to_caches(None, arrays, len(tokens)), n), n, (version, ns)
        for score, version, _seq, key, ns in ranked[:CANDIDATES]:
            found = self._from_memory(ns, prompt, score) or self._from_disk(key, ns, prompt)
            if found is not None:
                n, cache = found
                self._count_hit(n, version, window)
                return cache, n, (version, ns)
        self._count(misses=1)
        return None, 0, window[0]

    def _from_memory(self, ns: str, prompt: np.ndarray, score: int):
        """(n, KV) from the memory tier if it holds at least SCORE tokens of prompt in ns."""
        with self._lock:  # LRUPromptCache hands out a deep copy, trimmed to the common prefix
            cache, rest = self._memory.fetch_nearest_cache(ns, prompt.tolist())
        n = min(len(prompt) - len(rest), len(prompt) - 1)  # it leaves one only when it must
        if cache is None or n < max(min(score, len(prompt) - 1), 1):
            return None
        self._count(memory_hits=1)
        return n, fresh_kv(cache, n)

    def _from_disk(self, key: str, ns: str, prompt: np.ndarray):
        blob = self._disk.get(key)
        if blob is None:  # culled or deleted behind the index's back
            with self._lock:
                self._index.drop(key)
            return None
        try:
            tokens, meta, arrays = unpack(blob, verify=True)
            if meta["ns"] != ns or len(tokens) != Entry.parse(key).length:
                raise CorruptEntry("header does not match its key")
        except CorruptEntry as e:
            log.warning("prefix cache entry ignored and deleted: %s", e)
            self._count(corrupt=1)
            with self._lock:
                self._index.drop(key)
            self._queue.put(("delete", key))
            return None
        self._count(disk_hits=1, bytes_read=len(blob))
        with self._lock:
            if key in self._index.entries:  # recently used: the budget keeps it longer
                self._index.touch(self._index.entries[key])
        caches = to_caches(meta["quant"], arrays, len(tokens))
        self._remember(ns, tokens, caches)  # the next turn of this session finds it in memory
        n = min(common_prefix(tokens, prompt), len(prompt) - 1)
        return (n, fresh_kv(caches, n)) if n >= 1 else None

    def _count_hit(self, n: int, version: int, window: list, **more) -> None:
        stale = {"hits_stale": 1, "cached_tokens_stale": n} if version != window[0][0] else {}
        self._count(hits=1, cached_tokens=n, **stale, **more)

    # ---- writer thread ----

    def _write_loop(self) -> None:
        with mlx_thread():
            while True:
                item = self._queue.get()
                try:
                    if item is None:
                        break
                    if item[0] == "put":
                        self._write(*item[2:])
                    elif item[0] == "stale":
                        lineage = self.lineage(item[2])
                        self._evict_versions(item[1], lineage.base)
                        lineage.save()
                    elif item[0] == "delete":
                        self._disk.delete(item[1])
                except OSError as e:  # a full disk: not kept; it is only a cache
                    log.warning("prefix cache write failed: %s", e)
                    self._count(errors=1)
                except Exception:
                    log.exception("prefix cache write failed")
                    self._count(errors=1)
                finally:
                    if item is not None and item[0] == "put":
                        with self._small:
                            self._pending.pop(item[1], None)  # stored now, or failed
                    item = None  # free the KV arrays here, not while waiting for the next item
                    self._queue.task_done()
            if self._disk is not None:
                self._disk.close()  # this thread's SQLite connection

    def _write(self, ns: str, version: int, tokens: np.ndarray, arrays: list, ends,
               base: str) -> None:
        n = len(tokens)
        quant = self.quant if self.quant and n >= self.quantized_kv_start else None
        if quant:
            arrays = [q for a in arrays for q in mx.quantize(a, group_size=quant[0], bits=quant[1])]
            mx.eval(arrays)
        blob = pack(tokens, arrays, {"format": FORMAT, "ns": ns, "version": version,
                                     "length": n, "quant": quant})
        caches, arrays = to_caches(quant, arrays, n), None
        hashes = block_hashes(ns, tokens, self.block)
        with self._lock:  # entries this one extends are superseded; keep their boundaries
            older = self._index.superseded(ns, tokens, hashes)
        lengths = {x for x in ends if 0 < x <= n} | {n}
        lengths |= {x for e in older for x, _ in e.ends}
        entry = Entry(base, version, ns, n, len(blob), tuple(hashes[1:]),
                      tuple((x, end_hash(hashes, tokens, self.block, x))
                            for x in sorted(lengths)[-MAX_ENDS:]))
        key = entry.key
        on_disk = len(blob) + 64 * 1024 <= self.disk_limit  # else larger than the whole budget
        if on_disk:
            self._make_room(len(blob))
            self._disk.set(key, blob, tag=ns)
        with self._lock:
            self._index.add(entry, memory_only=not on_disk)
            for e in older:
                if e.key != key:
                    self._index.drop(e.key)
        self._remember(ns, tokens, caches)  # its prefixes leave the memory tier with it
        self._count(stores=1, bytes_written=len(blob) if on_disk else 0)
        for e in older:
            if e.key != key:
                self._disk.delete(e.key)
        if on_disk:
            culled = self._disk.cull()
            if culled:  # diskcache's own cull, past the budget: the index forgets them too
                self._count(evicted_budget=culled)
                on_disk = set(self._disk.iterkeys())
                with self._lock:
                    self._index.forget_missing(on_disk)
        self._disk_bytes = self._disk.volume()

    def _remember(self, ns: str, tokens: np.ndarray, caches: list) -> None:
        if sum(c.nbytes for c in caches) <= self.memory_limit:  # else it would evict it all
            with self._lock:
                self._memory.insert_cache(ns, tokens.tolist(), caches)

    def _make_room(self, size: int) -> None:
        """Entries outside the window (other adapters, models or KV settings) go first, then
        the least recently used, one at a time: diskcache's own cull deletes ten at once, which
        under a small budget empties the store."""
        if self._disk.volume() + size <= self.disk_limit:
            return
        servable = {ns for lineage in [self._lineage, *list(self._lineages.values())]
                    for _, ns in lineage.served[2]}
        with self._lock:
            order = self._index.eviction_order(servable)
        for e in order:
            self._disk.delete(e.key)
            with self._lock:
                self._index.drop(e.key)
            self._count(**{"evicted_budget" if e.ns in servable else "evicted_stale": 1})
            if self._disk.volume() + size <= self.disk_limit:
                return

    def _evict_versions(self, version: int, base: str) -> None:
        """Versions older than the window of the one now served (v - N) are never served
        again: evict their namespaces' tags (of the lineage whose entries carry BASE)."""
        oldest = version - self.max_lag
        with self._lock:
            old = self._index.older_than(base, oldest)
            for e in old:
                self._index.drop(e.key)
        self._count(evicted_stale=len(old))
        for ns in {e.ns for e in old}:
            self._disk.evict(ns)
        self._disk_bytes = self._disk.volume()

    def _count(self, **deltas) -> None:
        with self._small:
            for name, d in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + d)

    # ---- any thread ----

    def flush(self) -> None:
        """Wait until every queued write is on disk (tests, benchmarks, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=120)
        if self._disk is not None:
            self._disk.close()

    def health(self) -> dict:
        """What /healthz shows under "prefix_cache". Never waits for a lookup or a write (the
        event loop calls it)."""
        with self._small:
            out = asdict(self.stats)
        out.update(
            entries=len(self._index.entries),
            memory_entries=len(self._memory),
            memory_bytes=self._memory.nbytes,
            entries_by_version=self._index.versions(self.base),
            enabled=self.unsupported is None,
            reason=self.unsupported,
            directory=str(self.directory),
            adapter_version=self._lineage.served[0],
            kv_reuse_max_lag=self.max_lag,
            servable_versions=[v for v, _ in self.window()],  # entries of these may be reused
            disk_bytes=self._disk_bytes,
            disk_limit_bytes=self.disk_limit,
            memory_limit_bytes=self.memory_limit,
            block_tokens=self.block,
            pending_writes=self._queue.qsize(),
            kv_quantization={"stored_entries": None if self.quant is None else {
                "bits": self.quant[1], "group_size": self.quant[0],
                "quantized_kv_start": self.quantized_kv_start}, "live_decoding": LIVE_KV})
        return out


def open_prefix_cache(directory: str | Path, settings: CacheSettings, model: nn.Module,
                      model_id: str) -> PrefixCache:
    """The store for this model, checked against it. Runs a little MLX work (a digest of the
    weights, a probe when quantizing): call it where the model was loaded, before the engine
    thread starts."""
    unsupported = unstorable(model)
    if unsupported is None and settings.kv_bits:
        group = settings.kv_group_size or default_group_size(model)
        check_quantizable(model, settings.kv_bits, group)
        settings = settings.model_copy(update={"kv_group_size": group})
    return PrefixCache(directory, settings, model_key(model, model_id), unsupported)
