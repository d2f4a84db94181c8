"""The prefix KV cache: prompt KV state kept in memory and on disk, found by longest prefix.

Agent prompts are long and mostly repeated (system prompt, tool schemas, the conversation so
far), so the engine asks the store for the longest stored prefix of each new prompt and
prefills only the rest.

Owns its entries' keys and bytes (blobs.py), the index over them (index.py), which adapter
versions' KV may be reused (lineage.py) and the store itself (prefix_cache.py; disk.py opens it). Used by the
engine only; knows nothing of requests or sessions.

- **Entry**: the KV state (every layer's keys and values) of one token sequence, a request's
  prompt + completion. At a request's end mlx-lm's BatchGenerator holds KV for the prompt and
  *every* sampled token, the last one included (it runs the forward pass on a token before it
  returns it; checked against a from-scratch pass), so an entry covers all of `all_tokens`.
  Namespaced by model identity (id + a sample of the base weights), KV settings and adapter
  (version + a fingerprint of the LoRA weights, so a restart that reuses a version number with
  other weights never matches). An entry whose tokens are a prefix of a newer one is dropped:
  a session keeps one entry that grows turn by turn.
- **Personal adapters** (serving/personal.py) each have a lineage of their own, named by the
  engine's name for the adapter: its own base (so its entries, window and evictions are its
  own), its own `lineage-NAME.json`. A lookup or a store names the lineage; the live adapter's
  is the default one.
- **Stale reuse**: a lookup also accepts entries of the N adapters before the one served. An
  entry is stored under the *oldest* adapter whose KV it holds (the engine says which), so no
  token's KV is ever more than N versions old: staleness stays bounded instead of compounding.
- **Lookup** (on the loader thread, never the engine's): the block index ranks the entries of
  the window by how much of the prompt they share; the best one's namespace is asked of the
  memory tier, else its blob is read from disk. The KV handed out is trimmed to the exact
  common prefix, leaving at least one prompt token to prefill, in fresh arrays: a request never
  shares KV with another or with the store.
- **Memory tier**: mlx-lm's `LRUPromptCache` (a token trie per namespace, a byte budget,
  entries superseded by a longer one dropped), holding the KV as mlx-lm caches, quantized when
  the entry is. Ours stays in front of it: the disk tier and its CRC, and the block index that
  says which namespace to ask (asking each namespace of the window would deep-copy KV from
  every one that matches). Entries the index forgets (evicted from disk, or of an adapter past
  the window) are never asked for and age out of the LRU.
- **Writes** happen on the writer thread: the engine thread only evaluates the extracted KV
  (MLX arrays must be evaluated on the thread that built them) and queues it; quantization,
  serialization, hashing, disk IO and the memory tier run there. A full queue drops the write,
  never blocks decode. Until the writer has stored it, a queued write serves lookups from its
  own arrays, so an agent's next request that arrives within milliseconds still hits. The
  engine thread and `health` never wait for a lookup: they share only a short-held lock.
- **Integrity**: each blob carries a magic, its length and a CRC-32; a truncated or altered
  entry (e.g. after a crash) is counted, deleted and never served.
- **Eviction**: the disk budget covers the entries plus diskcache's SQLite file (not its WAL).
  Each disk entry is tagged with its namespace; publishing adapter version v evicts the tags of
  versions older than v - N (never served again: diskcache's `evict(tag)`). Under budget
  pressure entries outside the window go first, then the least recently written or read, one at
  a time (diskcache's `cull` deletes ten at once). One server per data directory.
- **KV quantization** (`--kv-bits`, `--kv-group-size`, `--quantized-kv-start`; by default 8
  bits from 8,192 tokens, so an agent's 16k-token SmolLM2 entry is 207 MB, not 737) applies to
  *stored entries only*: entries of at least `quantized_kv_start` tokens are kept quantized in
  memory and on disk (3.6-6.4x smaller) and dequantized on restore, so their output is close to,
  not equal to, output from scratch. Live decoding always keeps full-precision KV: mlx-lm 0.32's
  BatchGenerator has no kv_bits option and cannot batch a QuantizedKVCache (no `merge`).
- Models whose cache layers are not all plain `KVCache` (sliding windows, SSM state) are not
  cached; /healthz says so.
"""
