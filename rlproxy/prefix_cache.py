"""The prefix KV store: prompt KV state kept in memory and on disk, found by longest prefix.

Agent prompts are long and mostly repeated (system prompt, tool schemas, the conversation so far),
so the engine asks this store for the longest stored prefix of each new prompt and prefills only
the rest. This module owns the entries, their index, an in-memory LRU, a `diskcache` directory
(`<data_dir>/prefix_cache/`), one writer thread and the counters /healthz shows. It does not own
the model or the decode loop: engine.py decides when to look up and when to store.
The entries' keys, hashes and byte format are kv_blobs.py.

- **Entry**: the KV state (every layer's keys and values) of one token sequence, a request's
  prompt + completion. At a request's end mlx-lm's BatchGenerator holds KV for the prompt and
  *every* sampled token, the last one included (it runs the forward pass on a token before it
  returns it; checked against a from-scratch pass), so an entry covers all of `all_tokens`.
  Namespaced by model identity (id + a sample of the base weights), KV settings and adapter
  (version + a fingerprint of the LoRA weights, so a restart that reuses a version number with
  other weights never matches). An entry whose tokens are a prefix of a newer one is dropped:
  a session keeps one entry that grows turn by turn.
- **Stale reuse** (`--kv-reuse-max-lag N`): a lookup also accepts entries computed under the
  N adapters that preceded the one served (its *window*), so a trainer step does not throw
  every agent's prefix away. Ancestry is by fingerprint, not by number: version v+1 published
  right after v in one process is v's child, and those links are kept in `lineage.json` so a
  restart that resumes a served adapter keeps its window. An entry is stored under the *oldest*
  adapter whose KV it holds (the engine says which), so no token's KV is ever more than N
  versions old: staleness stays bounded instead of compounding turn after turn. N = 0 accepts
  the served adapter's own entries only.
- **Lookup**: chained hashes of fixed-size token blocks (`prefix_block_tokens`) find the entries
  sharing the most whole blocks with the prompt; hashes of each entry's turn boundaries (prompt
  end, completion end, earlier turns') find exact-length prefixes inside a block. The chosen
  entry's own tokens then give the exact common prefix; the entry is trimmed to it
  (`trim_prompt_cache`), leaving at least one prompt token to prefill. Every restore builds
  fresh arrays: a request never shares KV with another.
- **Writes** happen on the writer thread: the engine thread only evaluates the extracted KV
  (MLX arrays must be evaluated on the thread that built them) and queues it; serialization,
  quantization, hashing and disk IO run there. A full queue drops the write, never blocks decode.
  Until the writer has indexed it, a queued write serves lookups from its own arrays, so an
  agent's next request that arrives within milliseconds still hits.
- **Integrity**: each blob carries a magic, its length and a CRC-32; a truncated or altered
  entry (e.g. after a crash) is counted, deleted and never served.
- **Eviction**: the disk budget covers the entries plus diskcache's SQLite file (not its WAL).
  Publishing adapter version v deletes entries older than v - N (never served again); under
  budget pressure entries outside the window (other adapters, models or KV settings) go first,
  then diskcache culls the least recently used. One server per data directory.
- **KV quantization** (`--kv-bits`, `--kv-group-size`, `--quantized-kv-start`) applies to
  *stored entries only*: entries of at least `quantized_kv_start` tokens are kept quantized in
  memory and on disk (4-8x smaller) and dequantized on restore, so their output is close to,
  not equal to, output from scratch. Live decoding always keeps full-precision KV: mlx-lm 0.32's
  BatchGenerator has no kv_bits option and cannot batch a QuantizedKVCache (no `merge`).
- Models whose cache layers are not all plain `KVCache` (sliding windows, SSM state) are not
  cached; /healthz says so.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import queue
import threading
from collections import Counter, OrderedDict
from pathlib import Path

import diskcache
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache, trim_prompt_cache

from rlproxy.kv_blobs import (
    FORMAT, CorruptEntry, Entry, block_hashes, common_prefix, digest, end_hash, model_key, pack,
    to_kv_cache, unpack,
)
from rlproxy.settings import CacheSettings

log = logging.getLogger("rlproxy.prefix_cache")

MAX_ENDS = 32  # turn boundaries remembered per entry
MAX_PENDING = 8  # queued writes hold KV arrays in memory; past this a write is dropped
CANDIDATES = 3  # entries tried per lookup when the best ones turn out corrupt or gone
LINEAGE = "lineage.json"  # the window's (version, namespace) links, newest first
LIVE_KV = ("full precision: mlx-lm's BatchGenerator has no kv_bits and cannot batch a "
           "QuantizedKVCache, so --kv-bits applies to stored entries only")


# ---- the store ----

class PrefixCache:
    """Thread use: `set_adapter`, `fetch` and `put` on the engine thread; `counters` anywhere;
    everything that writes runs on the store's own writer thread."""

    def __init__(self, directory: str | Path, settings: CacheSettings, model_identity: str,
                 unsupported: str | None = None):
        self.directory = Path(directory)
        self.block = settings.prefix_block_tokens
        self.quant = [settings.kv_group_size, settings.kv_bits] if settings.kv_bits else None
        self.quantized_kv_start = settings.quantized_kv_start
        start = self.quantized_kv_start if self.quant else 0
        kv = json.dumps({"quant": self.quant, "start": start})
        self.base = digest(model_identity.encode(), kv.encode(), person=b"base")
        self.unsupported = unsupported
        self.disk_limit = int(settings.prefix_cache_disk_limit_gb * 1024**3)
        self.memory_limit = int(settings.prefix_cache_memory_mb * 1024**2)
        self.max_lag = settings.kv_reuse_max_lag
        self.version, self.ns = 0, None  # set by the engine (set_adapter) before any lookup
        self._window: list[tuple[int, str]] = []  # (version, ns) servable now, newest first
        self._parents = self._read_lineage()  # ns -> (version, ns) of the adapter it came from
        self._resets: set[int] = set()  # versions that start a lineage of their own (rollback)
        self._seen: dict[str, int] = {}  # fingerprint -> the version first served with it
        self._lock = threading.Lock()  # index, memory LRU, counters
        self._entries: dict[str, Entry] = {}
        self._by_block: dict[str, set[str]] = {}  # block hash -> keys of entries containing it
        self._short: dict[str, set[str]] = {}  # ns -> keys with a boundary inside the 1st block
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._memory_bytes = 0
        self._seq = 0
        self._pending: dict[int, tuple[str, int, np.ndarray, list]] = {}  # queued writes
        self._write_ids = itertools.count()
        self.stats = dict.fromkeys(
            ["lookups", "hits", "memory_hits", "disk_hits", "misses", "cached_tokens",
             "hits_stale", "cached_tokens_stale", "stores", "dropped_writes",
             "not_stored_stale", "corrupt", "evicted_stale", "evicted_budget",
             "bytes_written", "bytes_read", "errors"], 0)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._disk = diskcache.Cache(
            str(self.directory), size_limit=self.disk_limit, cull_limit=0,  # we cull, after
            eviction_policy="least-recently-used", disk_min_file_size=0,  # every entry a file
        )
        self._disk_bytes = self._disk.volume()
        self._scan()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="rlproxy-prefix-writer",
                                        daemon=True)
        self._writer.start()

    # ---- engine thread ----

    def set_adapter(self, version: int, fingerprint: str) -> None:
        """The engine now serves this adapter: look up under it and the N before it."""
        ns = digest(self.base.encode(), f"{version}:{fingerprint}".encode(), person=b"ns")
        reset = version in self._resets or self._seen.get(fingerprint, version) < self.version
        self._resets.discard(version)
        self._seen.setdefault(fingerprint, version)
        if (self.ns is not None and version == self.version + 1 and ns not in self._parents
                and not reset):  # a rollback's weights did not come from the served adapter
            # One trainer step: the adapter served until now is this one's parent. The first
            # link recorded wins, so a restart's jump to a resumed version keeps its history.
            self._parents[ns] = (self.version, self.ns)
        window = [(version, ns)]
        while len(window) <= self.max_lag and window[-1][1] in self._parents:
            window.append(self._parents[window[-1][1]])
        self.version, self.ns, self._window = version, ns, window
        self._queue.put(("stale", version))

    def reset_lineage(self, version: int) -> None:
        """VERSION, about to be published, is not a training step from the adapter served now
        (a rollback to an old checkpoint): KV from the versions before it must not be reused
        under it. Any thread; call it before publishing."""
        self._resets.add(version)

    def fetch(self, prompt: list[int]) -> tuple[list[KVCache] | None, int, tuple[int, str]]:
        """(a fresh cache holding the longest stored prefix of prompt, its length, source):
        source is (version, namespace) of the adapter that computed that KV, or of the one
        served on a miss; hand it back to `put`. At least one prompt token is left to prefill.
        Among the window's versions the longest prefix wins, the newest on a tie."""
        source = (self.version, self.ns)
        if self.unsupported or self.ns is None or len(prompt) < 2:
            return None, 0, source
        try:
            return self._fetch(np.asarray(prompt, dtype=np.int32))
        except Exception:  # a bug here costs speed, never the request
            log.exception("prefix cache lookup failed")
            self._count(errors=1, misses=1)
            return None, 0, source

    def put(self, tokens: list[int], cache: list, ends: list[int],
            source: tuple[int, str]) -> None:
        """Queue a finished request's KV (covering exactly `tokens`) for storing under `source`,
        the oldest adapter that computed any of it (from `fetch`); `ends` are its turn
        boundaries (prompt end, completion end). KV older than the window is not stored."""
        if self.unsupported or self.ns is None or len(tokens) < 2:
            return
        if source not in self._window:  # an adapter swap outran it by more than N versions
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
        with self._lock:
            self._pending[write_id] = (ns, version, tokens, arrays)
        self._queue.put(("put", write_id, ns, version, tokens, arrays, ends))

    def _fetch(self, prompt: np.ndarray):
        window = self._window
        hashes = {ns: block_hashes(ns, prompt, self.block) for _, ns in window}
        with self._lock:
            self.stats["lookups"] += 1
            ranked = sorted(((score, version, seq, key, ns) for version, ns in window
                             for score, seq, key in self._rank(ns, prompt, hashes[ns])),
                            reverse=True)  # longest first, then newest version, then recency
            queued = [(common_prefix(t, prompt), version, q_ns, t, arrays)
                      for q_ns, version, t, arrays in self._pending.values()
                      if (version, q_ns) in window]
        best = max(queued, key=lambda q: q[:2], default=None)
        if best is not None and best[0] >= 1 and best[:2] >= (ranked[0][:2] if ranked else (0,)):
            n, version, ns, tokens, arrays = min(best[0], len(prompt) - 1), *best[1:]
            if n >= 1:  # fresh cache objects over evaluated arrays nobody mutates
                cache = to_kv_cache({"quant": None}, arrays)
                trim_prompt_cache(cache, len(tokens) - n)
                self._count_hit(n, version, memory_hits=1)
                return cache, n, (version, ns)
        for _score, version, _seq, key, ns in ranked[:CANDIDATES]:
            loaded = self._load(key, ns)
            if loaded is None:
                continue
            tokens, cache = loaded
            n = min(common_prefix(tokens, prompt), len(prompt) - 1)
            if n < 1:
                continue
            trim_prompt_cache(cache, len(tokens) - n)
            self._count_hit(n, version)
            return cache, n, (version, ns)
        self._count(misses=1)
        return None, 0, window[0]

    def _count_hit(self, n: int, version: int, **more) -> None:
        stale = {"hits_stale": 1, "cached_tokens_stale": n} if version != self.version else {}
        self._count(hits=1, cached_tokens=n, **stale, **more)

    def _rank(self, ns: str, prompt: np.ndarray, hashes: list[str]):
        """Candidate entries, best first: (tokens known to match, recency, key). Lock held."""
        level, keys = 0, self._short.get(ns, set())
        for k in range(len(hashes) - 1, 0, -1):  # the deepest block any entry shares
            if hashes[k] in self._by_block:
                level, keys = k, self._by_block[hashes[k]]
                break
        ranked = []
        for key in keys:
            e = self._entries[key]
            score = level * self.block
            for n, h in e.ends:  # an exact turn boundary inside the next block beats the block
                if score < n <= len(prompt) and n // self.block == level \
                        and h == end_hash(hashes, prompt, self.block, n):
                    score = n
            if score:
                ranked.append((score, e.seq, key))
        return sorted(ranked, reverse=True)

    def _load(self, key: str, ns: str):
        with self._lock:
            blob = self._memory.get(key)
            if blob is not None:
                self._memory.move_to_end(key)
        where = "memory" if blob is not None else "disk"
        if blob is None:
            blob = self._disk.get(key)
            if blob is None:  # culled or deleted behind the index's back
                with self._lock:
                    self._drop(key)
                return None
        try:
            tokens, meta, arrays = unpack(blob, verify=where == "disk")
            if meta["ns"] != ns or len(tokens) != Entry.parse(key).length:
                raise CorruptEntry("header does not match its key")
        except CorruptEntry as e:
            log.warning("prefix cache entry ignored and deleted (%s): %s", where, e)
            self._count(corrupt=1)
            with self._lock:
                self._drop(key)
            self._queue.put(("delete", key))
            return None
        if where == "disk":
            with self._lock:
                self._remember(key, blob)
            self._count(disk_hits=1, bytes_read=len(blob))
        else:
            self._count(memory_hits=1)
        return tokens, to_kv_cache(meta, arrays)

    # ---- writer thread ----

    def _write_loop(self) -> None:
        stream = mx.new_stream(mx.default_device())  # MLX streams are per thread
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    break
                if item[0] == "put":
                    self._write(stream, *item[2:])
                elif item[0] == "stale":
                    self._evict_versions(item[1])
                    self._write_lineage()
                elif item[0] == "delete":
                    self._disk.delete(item[1])
            except Exception:
                log.exception("prefix cache write failed")
                self._count(errors=1)
            finally:
                if item is not None and item[0] == "put":
                    with self._lock:
                        self._pending.pop(item[1], None)  # indexed now, or failed
                item = None  # free the KV arrays here, not while waiting for the next item
                self._queue.task_done()
        self._disk.close()  # this thread's SQLite connection
        mx.clear_streams()  # each MLX thread must, or the process can abort at exit
        gc.collect()
        mx.synchronize(stream)

    def _write(self, stream, ns: str, version: int, tokens: np.ndarray, arrays: list, ends):
        n = len(tokens)
        quant = self.quant if self.quant and n >= self.quantized_kv_start else None
        if quant:
            with mx.stream(stream):
                arrays = [q for a in arrays
                          for q in mx.quantize(a, group_size=quant[0], bits=quant[1])]
                mx.eval(arrays)
        blob = pack(tokens, arrays, {"format": FORMAT, "ns": ns, "version": version,
                                     "length": n, "quant": quant})
        arrays = None
        hashes = block_hashes(ns, tokens, self.block)
        with self._lock:  # entries this one extends are superseded; keep their boundaries
            older = [e for e in self._entries.values() if e.ns == ns and e.length <= n
                     and e.ends[-1][1] == end_hash(hashes, tokens, self.block, e.length)]
        lengths = {x for x in ends if 0 < x <= n} | {n}
        lengths |= {x for e in older for x, _ in e.ends}
        self._seq += 1
        entry = Entry(self.base, version, ns, n, len(blob), tuple(hashes[1:]),
                      tuple((x, end_hash(hashes, tokens, self.block, x))
                            for x in sorted(lengths)[-MAX_ENDS:]), seq=self._seq)
        key = entry.key
        with self._lock:
            self._add(entry)
            self._remember(key, blob)
            for e in older:
                if e.key != key:
                    self._drop(e.key)
            self.stats["stores"] += 1
        for e in older:
            if e.key != key:
                self._disk.delete(e.key)
        if len(blob) + 64 * 1024 > self.disk_limit:
            return  # larger than the whole disk budget: memory only
        self._make_room(len(blob))
        self._disk.set(key, blob)
        self._count(bytes_written=len(blob))
        culled = self._disk.cull()
        if culled:
            self._count(evicted_budget=culled)
            self._forget_missing()
        self._disk_bytes = self._disk.volume()

    def _make_room(self, size: int) -> None:
        """Entries outside the window (other adapters, models or KV settings) go first."""
        if self._disk.volume() + size <= self.disk_limit:
            return
        servable = {ns for _, ns in self._window}
        with self._lock:
            stale = sorted((e for e in self._entries.values() if e.ns not in servable),
                           key=lambda e: e.seq)
        for e in stale:
            self._disk.delete(e.key)
            with self._lock:
                self._drop(e.key)
            self._count(evicted_stale=1)
            if self._disk.volume() + size <= self.disk_limit:
                return

    def _evict_versions(self, version: int) -> None:
        """Versions older than the window of the one now served (v - N) are never served
        again: delete them."""
        oldest = version - self.max_lag
        with self._lock:
            old = [e for e in self._entries.values() if e.base == self.base and e.version < oldest]
            for e in old:
                self._drop(e.key)
            self.stats["evicted_stale"] += len(old)
        for e in old:
            self._disk.delete(e.key)
        self._disk_bytes = self._disk.volume()

    def _read_lineage(self) -> dict[str, tuple[int, str]]:
        try:
            window = json.loads((self.directory / LINEAGE).read_text())
            return {ns: (int(v), p) for (_, ns), (v, p) in zip(window, window[1:])}
        except (OSError, ValueError, TypeError):  # none yet, or unreadable: no history
            return {}

    def _write_lineage(self) -> None:
        if self.max_lag:  # links matter only to a window wider than the served adapter
            tmp = self.directory / (LINEAGE + ".tmp")
            tmp.write_text(json.dumps(self._window))
            tmp.replace(self.directory / LINEAGE)

    def _forget_missing(self) -> None:
        on_disk = set(self._disk.iterkeys())
        with self._lock:
            for key in [k for k in self._entries if k not in on_disk and k not in self._memory]:
                self._drop(key)

    # ---- index and memory LRU (lock held) ----

    def _scan(self) -> None:
        for key in list(self._disk.iterkeys()):
            entry = Entry.parse(key)
            if entry is None:
                self._disk.delete(key)  # not ours, or an older format
            else:
                self._add(entry)

    def _add(self, e: Entry) -> None:
        self._entries[e.key] = e
        for h in e.blocks:
            self._by_block.setdefault(h, set()).add(e.key)
        if e.ends[0][0] < self.block:
            self._short.setdefault(e.ns, set()).add(e.key)

    def _drop(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            for h in e.blocks:
                keys = self._by_block.get(h)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del self._by_block[h]
            self._short.get(e.ns, set()).discard(key)
        blob = self._memory.pop(key, None)
        if blob is not None:
            self._memory_bytes -= len(blob)

    def _remember(self, key: str, blob: bytes) -> None:
        if len(blob) > self.memory_limit:
            return
        old = self._memory.pop(key, None)
        self._memory_bytes += len(blob) - (len(old) if old is not None else 0)
        self._memory[key] = blob
        while self._memory_bytes > self.memory_limit:
            _, evicted = self._memory.popitem(last=False)
            self._memory_bytes -= len(evicted)

    def _count(self, **deltas) -> None:
        with self._lock:
            for name, d in deltas.items():
                self.stats[name] += d

    # ---- any thread ----

    def flush(self) -> None:
        """Wait until every queued write is on disk (tests, benchmarks, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=120)
        self._disk.close()

    def counters(self) -> dict:
        with self._lock:
            out = dict(self.stats)
            out.update(entries=len(self._entries), memory_entries=len(self._memory),
                       memory_bytes=self._memory_bytes)
            versions = Counter(e.version for e in self._entries.values() if e.base == self.base)
        out["entries_by_version"] = {str(v): n for v, n in sorted(versions.items())}
        out.update(
            enabled=self.unsupported is None,
            reason=self.unsupported,
            directory=str(self.directory),
            adapter_version=self.version,
            kv_reuse_max_lag=self.max_lag,
            servable_versions=[v for v, _ in self._window],  # entries of these may be reused
            disk_bytes=self._disk_bytes,
            disk_limit_bytes=self.disk_limit,
            memory_limit_bytes=self.memory_limit,
            block_tokens=self.block,
            pending_writes=self._queue.qsize(),
            kv_quantization={
                "stored_entries": None if self.quant is None else {
                    "bits": self.quant[1], "group_size": self.quant[0],
                    "quantized_kv_start": self.quantized_kv_start},
                "live_decoding": LIVE_KV},
        )
        return out


def open_prefix_cache(directory: str | Path, settings: CacheSettings, model: nn.Module,
                      model_id: str) -> PrefixCache:
    """The store for this model, checked against it. Runs a little MLX work (a digest of the
    weights, a probe when quantizing): call it where the model was loaded, before the engine
    thread starts."""
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)})
    unsupported = None
    if kinds != ["KVCache"]:
        unsupported = f"the model's cache layers are {kinds}; only KVCache layers are stored"
    elif settings.kv_bits:
        probe = make_prompt_cache(model)
        model(mx.array([[0]]), cache=probe)
        try:
            mx.eval([mx.quantize(a, group_size=settings.kv_group_size, bits=settings.kv_bits)
                     for a in (probe[0].keys, probe[0].values)])
        except ValueError as e:
            raise ValueError(
                f"--kv-bits {settings.kv_bits} --kv-group-size {settings.kv_group_size} cannot "
                f"quantize this model's KV (head dim {probe[0].keys.shape[-1]}): {e}. Choose a "
                "--kv-group-size that divides the head dim (32, 64 or 128)") from None
    return PrefixCache(directory, settings, model_key(model, model_id), unsupported)
