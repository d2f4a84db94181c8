"""Whose KV may be reused under the adapter served now: the served adapter and the N before it.

With `--kv-reuse-max-lag N` the prefix cache accepts KV computed under the N adapters that led to
the one served (its *window*). Ancestry is by fingerprint, not by number: version v+1 published
right after v in one process is v's child; a rollback (an old checkpoint published as v+1), or
weights already served under an older version, start a lineage of their own. The links are kept
in `lineage.json`, so a restart that resumes a served adapter keeps its window. Knows nothing
about entries or IO beyond that one file; the store (kv/prefix_cache.py) owns both.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlproxy.kv.blobs import digest

LINEAGE = "lineage.json"  # the window's (version, namespace) links, newest first


def lineage_file(adapter: str | None) -> str:
    """The default adapter's `lineage.json`; a personal adapter's `lineage-NAME.json`."""
    return LINEAGE if adapter is None else f"lineage-{adapter.replace(':', '-')}.json"


class Lineage:
    """`set_adapter` from one thread (the engine's); `served` is replaced whole, so any thread
    may read it without a lock."""

    def __init__(self, directory: Path, base: str, max_lag: int, file: str = LINEAGE):
        self.path, self.base, self.max_lag = directory / file, base, max_lag
        # (version, ns) served now and the window servable with it, newest first
        self.served: tuple[int, str | None, list[tuple[int, str]]] = (0, None, [])
        self._parents = self._read()  # ns -> (version, ns) of the adapter it came from
        self._resets: set[int] = set()  # versions that start a lineage of their own (rollback)
        self._seen: dict[str, int] = {}  # fingerprint -> the version first served with it

    def set_adapter(self, version: int, fingerprint: str) -> None:
        old_version, old_ns, _ = self.served
        ns = digest(self.base.encode(), f"{version}:{fingerprint}".encode(), person=b"ns")
        reset = version in self._resets or self._seen.get(fingerprint, version) < old_version
        self._resets.discard(version)
        self._seen.setdefault(fingerprint, version)
        if (old_ns is not None and version == old_version + 1 and ns not in self._parents
                and not reset):  # a rollback's weights did not come from the served adapter
            # One trainer step: the adapter served until now is this one's parent. The first
            # link recorded wins, so a restart's jump to a resumed version keeps its history.
            self._parents[ns] = (old_version, old_ns)
        window = [(version, ns)]
        while len(window) <= self.max_lag and window[-1][1] in self._parents:
            window.append(self._parents[window[-1][1]])
        self.served = (version, ns, window)

    def reset(self, version: int) -> None:
        """VERSION, about to be published, is not a step from the adapter served now."""
        self._resets.add(version)

    def save(self) -> None:
        if self.max_lag:  # links matter only to a window wider than the served adapter
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(self.served[2]))
            tmp.replace(self.path)

    def _read(self) -> dict[str, tuple[int, str]]:
        try:
            window = json.loads(self.path.read_text())
            return {ns: (int(v), p) for (_, ns), (v, p) in zip(window, window[1:])}
        except (OSError, ValueError, TypeError):  # none yet, or unreadable: no history
            return {}
