"""The tinker SDK's clients, made from the settings, and every call to them with a deadline.

The SDK retries a learner that is down for up to five minutes inside one call, and makes its
session synchronously on the first call; `call` runs each call on a daemon thread of its own
and gives up after `tinker_timeout_s`, so the trainer thread never hangs on the
network. Failures come out as one of two errors:

  LearnerRefused      the caller is wrong: a rejected key, a base model the service does not
                      have, a run of another base model or rank, a bad request. Not retried;
                      a start-up error.
  LearnerUnavailable  the service is down, slow or failing on its side. The batch waits and is
                      tried again with backoff; serving goes on.
  LearnerFailed       (a LearnerUnavailable) it answered this request with a failure of its
                      own (a server-side error, a 500): retried as above, then charged to the
                      batch's turns (training/control.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import uuid
from pathlib import Path

from rlproxy.settings import RemoteSettings
from rlproxy.training.learner import (  # the loop's errors
    LearnerFailed, LearnerRefused, LearnerUnavailable)

log = logging.getLogger("rlproxy.remote")
REPLICA = "remote.json"  # under the data dir: this replica's id and default run name


def sdk():
    try:
        import tinker
    except ImportError:
        raise LearnerRefused("--trainer tinker and --sampler tinker need the tinker SDK: "
                             "pip install 'rlproxy[tinker]'") from None
    return tinker


def refusal(e: BaseException) -> str | None:
    """What to change when E is the caller's fault, else None (worth trying again)."""
    tinker = sdk()
    if isinstance(e, (tinker.AuthenticationError, tinker.PermissionDeniedError)):
        return (f"the Tinker service refused the API key ({e.status_code}): set "
                "TINKER_API_KEY or --tinker-api-key to a key it accepts")
    if isinstance(e, tinker.RequestFailedError):
        if str(getattr(e, "category", "")).lower().endswith("user"):
            return str(e.message).split(" for self.request_id=")[0]
        return None
    if isinstance(e, (tinker.BadRequestError, tinker.NotFoundError,
                      tinker.UnprocessableEntityError)):
        return f"the Tinker service rejected a request: {e}"
    return None


def failed_here(e: BaseException) -> bool:
    """The service ran the request and it failed there (not: unreachable, slow, a proxy's
    502/503/504 for a learner that is down)."""
    tinker = sdk()
    return (isinstance(e, tinker.RequestFailedError)
            or (isinstance(e, tinker.APIStatusError) and e.status_code == 500))


def call(fn, timeout: float, what: str):
    """fn() on a daemon thread of its own, within TIMEOUT seconds; LearnerRefused or
    LearnerUnavailable. A daemon: a call the SDK keeps retrying for minutes never holds up
    the process's exit."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            fut.set_exception(e)
    threading.Thread(target=run, name="rlproxy-tinker-call", daemon=True).start()
    try:
        return fut.result(timeout=timeout)
    except concurrent.futures.TimeoutError:
        raise LearnerUnavailable(f"{what}: no answer from the Tinker service in {timeout:g} s")
    except (LearnerRefused, LearnerUnavailable):
        raise
    except Exception as e:
        said = refusal(e)
        if said is not None:
            raise LearnerRefused(f"{what}: {said}") from None
        if failed_here(e):
            raise LearnerFailed(f"{what}: {type(e).__name__}: {str(e)[:500]}") from None
        raise LearnerUnavailable(f"{what}: {type(e).__name__}: {str(e)[:500]}") from None


def resolve(fut, timeout: float, what: str):
    """An SDK future's result within TIMEOUT, with `call`'s errors."""
    return call(lambda: fut.result(timeout=timeout), timeout + 1.0, what)


def api_key(r: RemoteSettings) -> str:
    key = r.tinker_api_key or os.environ.get("TINKER_API_KEY")
    if not key:
        raise LearnerRefused("--trainer tinker / --sampler tinker need a key: set TINKER_API_KEY "
                             "(or --tinker-api-key); an rlproxy learner without --api-key "
                             "accepts any key that starts with 'tml-'")
    if not key.startswith(("tml-", "eyJ")):
        raise LearnerRefused("the tinker SDK only sends keys that start with 'tml-': set "
                             "TINKER_API_KEY to one (an rlproxy learner's --api-key must be such "
                             "a key too)")
    return key


def service_client(r: RemoteSettings):
    """A ServiceClient for the settings' service (no network yet: the SDK connects lazily)."""
    tinker = sdk()
    os.environ.setdefault("TINKER_TELEMETRY", "0")  # nothing leaves for a third party
    return tinker.ServiceClient(base_url=r.tinker_url, api_key=api_key(r))


def base_model_name(settings, loaded) -> str:
    """The service's name for the model: --tinker-base-model, else the first served name."""
    return settings.remote.tinker_base_model or (
        settings.server.served_model_name or [loaded.model_id])[0]


def rest_client(r: RemoteSettings):
    """The SDK's RestClient (capabilities, weights URLs) for the settings' service."""
    return sdk().RestClient(base_url=r.tinker_url, api_key=api_key(r))


def replica_identity(data_dir: Path, r: RemoteSettings) -> dict:
    """{"replica": this data dir's id, "run": the run name}, kept in <data_dir>/remote.json so a
    restart rejoins the same run: --tinker-run when given, else a name made once for this data
    dir."""
    path = Path(data_dir) / REPLICA
    try:
        read = json.loads(path.read_text())
    except (OSError, ValueError):
        read = None
    kept = dict(read) if isinstance(read, dict) and isinstance(read.get("replica"), str) else {
        "replica": uuid.uuid4().hex[:8]}
    kept.setdefault("default_run", f"rlproxy-{kept['replica']}")
    ident = {"replica": kept["replica"], "run": r.tinker_run or kept["default_run"]}
    if kept != read:
        tmp = path.with_suffix(".tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(kept))
        os.replace(tmp, path)
    return ident
