"""What every benchmark shares: the result's environment block, percentiles, the server, the report.

It owns the JSON keys that say where a figure was taken (timestamp, model, BLAS, versions,
machine and its load, settings), starting the real app in this process on a free port, and
printing and writing a result. It knows nothing about what any benchmark measures: each script
builds its own figures, summary lines and flags. Scripts import it as `from common import ...`
(run as `python bench/NAME.py`, their own folder is on sys.path). `rlproxy serve` as a
subprocess (a free port, a wait until healthy, freeze and thaw, stop) is
rlproxy/ops/served.py's, which the tests use too.
"""

import rlproxy  # noqa: I001  (first: preloads OpenBLAS before anything imports mlx)

import json
import os
import platform
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
from aiohttp import web

from rlproxy.api import server
from rlproxy.app import create_app
from rlproxy.serving.blas import blas_in_use
from rlproxy.serving.model import LoadedModel
from rlproxy.settings import Settings


def environment(size: str, load_before: float, model_id: str | None = None,
                settings: dict | None = None) -> dict:
    """The result's first keys: when, which model, BLAS and versions, the machine, settings.

    `load_before` is the 1-minute load average taken when the run started (os.getloadavg()[0]);
    the one after is taken here, so call this once the measurements are done. `model_id` and
    `settings` (already JSON-ready) are left out when None."""
    env = {"timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "size": size}
    if model_id is not None:
        env["model_id"] = model_id
    env |= {
        "blas": blas_in_use(),
        "mlx_version": mx.__version__,
        "mlx_lm_version": version("mlx-lm"),
        "rlproxy_version": rlproxy.__version__,
        "machine": {"platform": platform.platform(), "processor": platform.machine(),
                    "python": platform.python_version(), "device": str(mx.default_device()),
                    "cpus": os.cpu_count(),
                    "load_average_1m": {"before": load_before, "after": os.getloadavg()[0]}},
    }
    if settings is not None:
        env["settings"] = settings
    return env


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, statistics.quantiles'
    "inclusive"); unlike statistics.quantiles it takes a single value too."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def start_server(settings: Settings,
                       loaded: LoadedModel | None) -> tuple[web.AppRunner, str]:
    """The real app on 127.0.0.1: (runner, base url). `loaded=None`: the app loads its own
    model. The caller owns `runner.cleanup()`, which stops the engine and judge threads."""
    runner = server.AppRunner(create_app(settings, loaded), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)  # port 0: the OS picks a free one
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def proc_memory_mb(pid: int) -> dict | None:
    """A process's resident memory now (VmRSS) and its peak so far (VmHWM), in MB, read from
    /proc (Linux; psutil is not a dependency). None once the process is gone or off Linux."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return None
    kb = {k: int(v.split()[0]) for k, _, v in (x.partition(":") for x in lines)
          if k in ("VmRSS", "VmHWM")}
    if len(kb) < 2:  # a zombie (exited, not yet reaped) has no memory lines
        return None
    return {"rss_mb": kb["VmRSS"] / 1024, "hwm_mb": kb["VmHWM"] / 1024}


def report(lines: list[str], result: dict, out: Path) -> None:
    """Print the summary lines, then write the whole result as JSON to `out`."""
    for line in lines:
        print(line)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")

