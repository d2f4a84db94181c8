"""The prefix cache's disk tier at start: open its diskcache directory and read the entries'
keys back into a block index. A damaged cache.db is set aside and a new, empty store opened; any
other failure to open it (a full disk, no permission, too many open files) is StoreUnavailable,
the store kept as it is (rlproxy/stores.py).

Not here: reading, writing or evicting entries (kv/prefix_cache.py), the index itself
(kv/index.py).
"""

from __future__ import annotations

from pathlib import Path

import diskcache

from rlproxy.kv.blobs import Entry
from rlproxy.kv.index import BlockIndex
from rlproxy.stores import open_or_set_aside


def open_disk(directory: Path, disk_limit: int, block: int) -> tuple[diskcache.Cache, BlockIndex]:
    """(the store under DIRECTORY, an index of its entries); keys not ours (another format)
    are deleted. StoreUnavailable when it cannot be opened and is not damaged."""

    def attempt() -> tuple[diskcache.Cache, BlockIndex]:
        index = BlockIndex(block)  # a fresh one each try: none of a failed scan's entries stay
        directory.mkdir(parents=True, exist_ok=True)
        disk = diskcache.Cache(
            str(directory), size_limit=disk_limit, cull_limit=0,  # the store culls, after
            eviction_policy="least-recently-used", disk_min_file_size=0,  # every entry a file
            tag_index=True,  # evict(tag): a namespace's entries at once
        )
        try:
            for key in list(disk.iterkeys()):
                entry = Entry.parse(key)
                if entry is None:
                    disk.delete(key)  # not ours, or an older format
                else:
                    index.add(entry)
        except BaseException:
            disk.close()
            raise
        return disk, index

    return open_or_set_aside(Path(directory), attempt, "the prefix cache")
