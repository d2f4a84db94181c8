"""Opening the SQLite stores under the data directory (the prefix KV cache, the stored
Responses) through damage: a store whose file is damaged (not a database, a malformed image) is
set aside as `<name>.corrupt-<time>` (records.set_aside: never deleted) and a new, empty one
opened; one that cannot be opened for another reason (a full disk, no permission, too many open
files) is intact, so it is kept as it is and the caller hears why (`StoreUnavailable`).

Not here: what the stores hold (kv/prefix_cache.py, api/response_store.py).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable, TypeVar

from rlproxy.records import set_aside

T = TypeVar("T")
SQLITE_CORRUPT, SQLITE_NOTADB = 11, 26  # sqlite3.h: a damaged file; a file not a database


class StoreUnavailable(RuntimeError):
    """An SQLite store that cannot be opened now though its file is intact (a full disk, no
    permission, too many open files): kept as it is, never set aside."""


def damaged(error: BaseException) -> bool:
    """Whether ERROR, raised opening an SQLite store, says its file is damaged (not a database,
    a malformed image), rather than that it cannot be opened now."""
    code = getattr(error, "sqlite_errorcode", None)  # on the errors SQLite itself raised
    return code is not None and (code & 0xFF) in (SQLITE_CORRUPT, SQLITE_NOTADB)  # of extended


def open_or_set_aside(path: Path, open_store: Callable[[], T], what: str) -> T:
    """OPEN_STORE() (an SQLite store in folder PATH). If its file is `damaged`, PATH is set
    aside and a new, empty store opened; any other failure is StoreUnavailable, saying what
    to do, with PATH left as it is: an intact store is never set aside."""
    try:
        return open_store()
    except (sqlite3.Error, OSError) as e:
        if not damaged(e) or not Path(path).exists():
            raise StoreUnavailable(
                f"{what} at {path} cannot be opened ({type(e).__name__}: {e}); it is kept as it "
                "is: free disk space, fix the folder's permissions or raise the open-files "
                "limit (ulimit -n), then start again") from e
        set_aside(Path(path), f"{type(e).__name__}: {e}; {what} starts empty")
    return open_store()
