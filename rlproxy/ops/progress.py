"""Progress for long work: tqdm bars on a terminal (none when stderr is not a TTY, so logs and
CI output stay clean), and one log line per long phase with its duration."""

from __future__ import annotations

import logging
import sys
import time
from contextlib import contextmanager

from tqdm import tqdm

log = logging.getLogger("rlproxy")


def bar(iterable=None, *, total: int | None = None, desc: str = "", unit: str = "it") -> tqdm:
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not sys.stderr.isatty(),
                dynamic_ncols=True)


def write(text: str) -> None:
    """Print a line without tearing a bar that is being drawn."""
    tqdm.write(text, file=sys.stdout)


@contextmanager
def phase(name: str):
    """Log NAME with how long it took, e.g. 'loaded the serving model in 2.3 s'."""
    tic = time.perf_counter()
    yield
    log.info("%s in %.1f s", name, time.perf_counter() - tic)
