"""--hosted-tools: what becomes of tools a client offers that rlproxy cannot offer the model.

Hosted tools (OpenAI's web_search, file_search, ...; Anthropic's server tools) are run by the
provider, and rlproxy runs no tool of its own. Codex CLI offers web_search by default, so the
default, `drop`, leaves such tools out of the prompt and logs one WARNING per client (its session
id, else its address and User-Agent); `reject` answers 400 as OpenAI's own server would for an
unknown tool type. Which tools count as hosted, and taking them out of a request, is each
dialect's (responses_input.py, messages_input.py); this module holds the warning and the few
clients it remembers. Knows nothing of a request's shape.
"""

from __future__ import annotations

import logging

from aiohttp import web

from rlproxy.appkeys import SETTINGS
from rlproxy.lru import LRU

log = logging.getLogger("rlproxy.server")

MAX_CLIENTS = 4096  # clients remembered as warned (a forgotten one is warned again, once)
WARNED: web.AppKey[LRU] = web.AppKey("hosted_tools_warned", LRU)


def dropping(request: web.Request) -> bool:
    return request.app[SETTINGS].server.hosted_tools == "drop"


def warn_dropped(request: web.Request, session_id: str | None, dropped: list[str]) -> None:
    """One WARNING the first time a client's hosted tools are left out of the prompt."""
    if not dropped:
        return
    session_id = request.headers.get("X-Session-Id") or session_id
    agent = request.headers.get("User-Agent", "")
    client = f"session {session_id!r}" if session_id else f"{request.remote} {agent!r}"
    warned = request.app[WARNED]
    if client in warned:
        return
    warned.add(client)
    log.warning("%s %s offers tools rlproxy does not run (%s): left out of the prompt and of "
                "the response's tools (--hosted-tools drop; reject answers 400 instead). Said "
                "once per client.", client, request.path, ", ".join(sorted(set(dropped))))
