"""Log output: `--log-format text` (the default, for people) or `json` (one object per line,
for log collectors), set up once in `main`; and what a JSON line says about its moment.

A JSON line carries the session id and turn uid of the request being served when there is one
(the context variables below, set per request by api/edge.py's middleware and api/turns.py),
and the adapter version the engine serves (`served`, set by ops/metrics.py's `observe_swap`).
Imports no other rlproxy module: the CLI sets up logging without loading the server's.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

SESSION_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("session_id",
                                                                       default=None)
TURN_UID: contextvars.ContextVar[str | None] = contextvars.ContextVar("turn_uid", default=None)
served = {"adapter_version": 0}  # one engine per process


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "logger": record.name,
                "message": record.getMessage(),
                "adapter_version": served["adapter_version"]}
        for key, var in (("session_id", SESSION_ID), ("turn_uid", TURN_UID)):
            value = getattr(record, key, None) or var.get()
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    if fmt not in ("text", "json"):
        raise ValueError(f"--log-format must be text or json, not {fmt!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    # like basicConfig: a no-op where logging is already set up (an embedding app, pytest)
    logging.basicConfig(level=level.upper(), handlers=[handler])
