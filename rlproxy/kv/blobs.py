"""The prefix cache's entries as keys and bytes: block hashes, adapter and model fingerprints,
the index key of an entry, the CRC-checked blob format (pack/unpack), the mlx-lm KV caches an
entry becomes (`to_caches` for the memory tier, `fresh_kv` for a request), and which models' KV
can be stored at all (`unstorable`, `check_quantizable`). Pure functions and one record type;
the store itself (index, memory tier, disk, writer thread, eviction) is kv/prefix_cache.py.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

MAGIC = b"RLPKV\x00\x01\x00"  # + u64 body length + u32 CRC-32 of the body
FORMAT = 2  # 2: disk entries are tagged with their namespace (diskcache evict by tag)
LIVE_KV = ("full precision: mlx-lm's BatchGenerator has no kv_bits and cannot batch a "
           "QuantizedKVCache, so --kv-bits applies to stored entries only")


class CorruptEntry(Exception):
    pass


# ---- hashing ----

def digest(*parts, person: bytes) -> str:
    h = hashlib.blake2b(digest_size=8, person=person)
    for p in parts:
        h.update(p)
    return h.hexdigest()


def block_hashes(ns: str, tokens: np.ndarray, block: int) -> list[str]:
    """[h0, h1, ...]: h_k commits to the namespace and tokens[:k * block] (chained)."""
    out, raw, step = [digest(ns.encode(), person=b"ns")], tokens.tobytes(), block * 4
    for k in range(len(tokens) // block):
        out.append(digest(out[-1].encode(), raw[k * step:(k + 1) * step], person=b"block"))
    return out


def end_hash(hashes: list[str], tokens: np.ndarray, block: int, length: int) -> str:
    """The hash of exactly tokens[:length] (a turn boundary), from the block chain."""
    k = length // block
    return digest(hashes[k].encode(), tokens[k * block:length].tobytes(), person=b"end")


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def adapter_fingerprint(model: nn.Module) -> str:
    """A digest of every trainable (LoRA) weight. Call it on the thread that owns the model."""
    return weights_fingerprint(dict(tree_flatten(model.trainable_parameters())))


def weights_fingerprint(weights: dict[str, mx.array]) -> str:
    """The same digest from an adapter's weights by name (evaluated on the caller's thread)."""
    mx.eval(list(weights.values()))
    h = hashlib.blake2b(digest_size=8, person=b"adapter")
    for name in sorted(weights):
        h.update(name.encode())
        h.update(memoryview(weights[name]))
    return h.hexdigest()


def model_key(model: nn.Module, model_id: str) -> str:
    """The base model's identity: its id plus names, shapes and the first values of each frozen
    weight (cheap, and enough to tell regenerated or fine-tuned weights apart)."""
    trainable = {name for name, _ in tree_flatten(model.trainable_parameters())}
    h = hashlib.blake2b(digest_size=8, person=b"model")
    for name, a in tree_flatten(model.parameters()):
        if name not in trainable:
            head = mx.contiguous(a.reshape(-1)[:64])
            mx.eval(head)
            h.update(f"{name}{a.shape}{a.dtype}".encode())
            h.update(memoryview(head))
    return f"{model_id}@{h.hexdigest()}"


# ---- which models' KV can be stored ----

def unstorable(model: nn.Module) -> str | None:
    """Why this model's KV is not stored (cache layers other than plain KVCache), or None."""
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)})
    if kinds != ["KVCache"]:
        return f"the model's cache layers are {kinds}; only KVCache layers are stored"
    return None


def default_group_size(model: nn.Module) -> int:
    """64 (the smaller entry), or 32 where 64 does not divide the head dim (a probe)."""
    probe = make_prompt_cache(model)
    model(mx.array([[0]]), cache=probe)
    return 64 if probe[0].keys.shape[-1] % 64 == 0 else 32


def check_quantizable(model: nn.Module, bits: int, group_size: int) -> None:
    """Raise ValueError, saying what to change, when --kv-bits/--kv-group-size cannot quantize
    this model's KV (a probe: one token through the model)."""
    probe = make_prompt_cache(model)
    model(mx.array([[0]]), cache=probe)
    try:
        mx.eval([mx.quantize(a, group_size=group_size, bits=bits)
                 for a in (probe[0].keys, probe[0].values)])
    except ValueError as e:
        raise ValueError(
            f"--kv-bits {bits} --kv-group-size {group_size} cannot quantize this model's KV "
            f"(head dim {probe[0].keys.shape[-1]}): {e}. Choose a --kv-group-size that divides "
            "the head dim (32, 64 or 128)") from None


# ---- entries: keys and blobs ----

@dataclass
class Entry:
    base: str  # model identity + KV settings
    version: int  # adapter version
    ns: str  # base + adapter version + adapter fingerprint: what a lookup must match
    length: int
    nbytes: int
    blocks: tuple[str, ...]  # h1 .. h_{length // block}
    ends: tuple[tuple[int, str], ...]  # (length, end_hash) per turn boundary, ascending
    seq: int = 0  # recency: newer wins ties and survives stale eviction longer

    @property
    def key(self) -> str:
        # Everything the index needs lives in the diskcache key, so a restart rebuilds the index
        # from the keys alone, and an eviction removes key and value together.
        ends = ",".join(f"{n}:{h}" for n, h in self.ends)
        return (f"kv{FORMAT}|{self.base}|{self.version}|{self.ns}|{self.length}|{self.nbytes}|"
                f"{''.join(self.blocks)}|{ends}")

    @classmethod
    def parse(cls, key) -> Entry | None:
        try:
            tag, base, version, ns, length, nbytes, blocks, ends = key.split("|")
            if tag != f"kv{FORMAT}" or len(blocks) % 16:
                return None
            return cls(base, int(version), ns, int(length), int(nbytes),
                       tuple(blocks[i:i + 16] for i in range(0, len(blocks), 16)),
                       tuple((int(n), h) for n, h in (e.split(":") for e in ends.split(","))))
        except (AttributeError, ValueError):
            return None


def _dtype_name(a: mx.array) -> str:
    return str(a.dtype).rsplit(".", 1)[-1]


def pack(tokens: np.ndarray, arrays: list[mx.array], meta: dict) -> bytes:
    """One entry as bytes: MAGIC, body length, CRC-32, then header JSON, tokens, raw arrays."""
    header = json.dumps({**meta, "arrays": [[_dtype_name(a), list(a.shape)] for a in arrays]})
    header = header.encode()
    parts = [struct.pack("<I", len(header)), header, tokens.astype(np.int32).tobytes(),
             *(memoryview(a) for a in arrays)]  # evaluated, contiguous: raw bytes, bf16 too
    crc, size = 0, 0
    for p in parts:
        crc = zlib.crc32(p, crc)
        size += memoryview(p).nbytes
    return b"".join([MAGIC, struct.pack("<QI", size, crc), *parts])


def unpack(blob: bytes, verify: bool) -> tuple[np.ndarray, dict, list[mx.array]]:
    """Parse a blob into (tokens, meta, fresh arrays); raise CorruptEntry on any damage."""
    try:
        if blob[:8] != MAGIC:
            raise CorruptEntry("bad magic")
        size, crc = struct.unpack_from("<QI", blob, 8)
        body = memoryview(blob)[20:]
        if len(body) != size:
            raise CorruptEntry(f"length {len(body)} != {size} (truncated?)")
        if verify and zlib.crc32(body) != crc:
            raise CorruptEntry("checksum mismatch")
        (hlen,) = struct.unpack_from("<I", body, 0)
        meta = json.loads(bytes(body[4:4 + hlen]))
        offset = 4 + hlen
        tokens = np.frombuffer(body, np.int32, meta["length"], offset)
        offset += tokens.nbytes
        arrays = []
        for dtype, shape in meta["arrays"]:
            raw = np.frombuffer(body, np.uint16 if dtype == "bfloat16" else np.dtype(dtype),
                                int(np.prod(shape)), offset).reshape(shape)
            offset += raw.nbytes
            a = mx.array(raw)  # a copy: the request owns it
            arrays.append(a.view(mx.bfloat16) if dtype == "bfloat16" else a)
        if offset != len(body):
            raise CorruptEntry("trailing bytes")
        return tokens, meta, arrays
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise CorruptEntry(f"unreadable: {e}") from None


def to_caches(quant: list | None, arrays: list[mx.array], length: int) -> list:
    """An entry's arrays (per layer: keys, values; or the 3 parts of each when quantized) as
    mlx-lm caches holding LENGTH tokens, for the memory tier (LRUPromptCache)."""
    caches = []
    if quant:
        for i in range(0, len(arrays), 6):
            c = QuantizedKVCache(group_size=quant[0], bits=quant[1])
            c.keys, c.values, c.offset = tuple(arrays[i:i + 3]), tuple(arrays[i + 3:i + 6]), length
            caches.append(c)
        return caches
    for i in range(0, len(arrays), 2):
        c = KVCache()
        c.state = (arrays[i], arrays[i + 1], length)
        caches.append(c)
    return caches


def fresh_kv(caches: list, n: int) -> list[KVCache]:
    """Plain full-precision caches over the first N tokens of CACHES, in new arrays (lazy:
    evaluate them on the calling thread). A request may write into them; the entry it came from
    never changes. Quantized entries are dequantized here: BatchGenerator cannot batch a
    QuantizedKVCache."""
    out = []
    for c in caches:
        if isinstance(c, QuantizedKVCache):
            keys, values = (mx.dequantize(*(a[..., :n, :] for a in parts),
                                          group_size=c.group_size, bits=c.bits)
                            for parts in (c.keys, c.values))
        else:
            keys, values = c.keys[..., :n, :], c.values[..., :n, :]
        kv = KVCache()
        kv.state = (keys, values, n)
        out.append(kv)
    return out

