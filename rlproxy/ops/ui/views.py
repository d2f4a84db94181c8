"""The dashboard's routes: its pages, the JSON they fetch under /ui/api, the login that sets
the API-key cookie, and a sampler of live rates (tokens/s, cache hit rate, TTFT percentiles).

Every value goes out as JSON and the pages insert it as text (app.js never uses innerHTML for
data), so recorded agent content cannot run in the browser. Reads the records only through the
incremental index, and live state from what the app's components report (their stats and
`health()`, by the keys in appkeys.py: none of them is imported). Changes nothing: the actions
(`/ui/api/adapters/{step}/serve`, `/ui/api/training/*`, `/ui/api/checkpoints`) and a
checkpoint's download are api/admin.py's, which mounts them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
from collections import deque
from pathlib import Path

from aiohttp import web

from rlproxy import paths
from rlproxy.appkeys import ENGINE, LIVE, MODEL, RECORD_INDEX, SCORER, SESSIONS, SETTINGS, \
    TRAINER
from rlproxy.ops import metrics, status
from rlproxy.ops.health import trainer_health
from rlproxy.ops.ui.index import RecordIndex
from rlproxy.protocol import APIError, json_response

STATIC = Path(__file__).resolve().parent / "static"
COOKIE = "rlproxy_api_key"
SAMPLE_S = 2.0
KEEP_SAMPLES = 900  # 30 minutes at SAMPLE_S
TTFT_WINDOW_S = 60.0
SESSION_PAGE = 100  # turns on one session page
TEXT_LIMIT = 4000  # characters of one message shown; the records keep all of it


def ui_context(settings):
    async def ctx(app: web.Application):
        index = RecordIndex(settings.records.data_dir)
        app[RECORD_INDEX], app[LIVE] = index, deque(maxlen=KEEP_SAMPLES)
        task = asyncio.create_task(sample_forever(app))
        yield
        task.cancel()

    return ctx


async def refreshed(app: web.Application) -> RecordIndex:
    """The index, caught up with the files (new bytes only; off the event loop)."""
    index = app[RECORD_INDEX]
    await asyncio.get_running_loop().run_in_executor(None, index.refresh)
    return index


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def sample_forever(app: web.Application) -> None:
    previous = None
    while True:
        engine = app[ENGINE]
        cache = engine.prefix_cache.stats if engine.prefix_cache is not None else None
        now = time.time()
        st = engine.stats
        point = {"t": now, "tokens": st.tokens, "hits": cache.hits if cache else 0,
                 "lookups": cache.lookups if cache else 0, "spec_steps": st.spec_steps,
                 "spec_tokens": st.spec_tokens, "drafted": st.spec_drafted,
                 "accepted": st.spec_accepted}
        ttft = [s for t, s in list(metrics.recent_ttft) if now - t <= TTFT_WINDOW_S]
        sample = {"t": round(now, 2), "ttft_p50": percentile(ttft, 0.5),
                  "ttft_p95": percentile(ttft, 0.95), "tokens_per_s": None,
                  "cache_hit_rate": None, "running": engine.stats.active,
                  "spec_acceptance": None, "spec_tokens_per_step": None}
        if previous is not None:
            dt = now - previous["t"]
            sample["tokens_per_s"] = round((point["tokens"] - previous["tokens"]) / dt, 2)
            lookups = point["lookups"] - previous["lookups"]
            if lookups:
                sample["cache_hit_rate"] = round((point["hits"] - previous["hits"]) / lookups, 4)
            if drafted := point["drafted"] - previous["drafted"]:  # speculation (lone streams)
                sample["spec_acceptance"] = round(
                    (point["accepted"] - previous["accepted"]) / drafted, 4)
            if steps := point["spec_steps"] - previous["spec_steps"]:
                sample["spec_tokens_per_step"] = round(
                    (point["spec_tokens"] - previous["spec_tokens"]) / steps, 3)
        app[LIVE].append(sample)
        previous = point
        try:
            await refreshed(app)
        except OSError:
            pass  # a record file being rotated by hand: next time
        await asyncio.sleep(SAMPLE_S)


# ---- pages ----

async def page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})


async def static(request: web.Request) -> web.FileResponse:
    name = request.match_info["name"]
    if name not in ("app.js", "style.css"):
        raise web.HTTPNotFound()
    return web.FileResponse(STATIC / name)


LOGIN = """<!doctype html><html><head><meta charset="utf-8"><title>rlproxy: sign in</title>
<style>body{font-family:sans-serif;margin:4em auto;max-width:24em}input{width:100%%;
padding:.4em;margin:.4em 0}</style></head><body><h2>rlproxy dashboard</h2>
<form method="post" action="/ui/login"><label>API key (--api-key)
<input type="password" name="key" autofocus></label><input type="submit" value="Sign in">
</form><p style="color:#b00">%s</p></body></html>"""


async def login(request: web.Request) -> web.Response:
    """GET: the form; POST: check the key and keep it in an HttpOnly, same-site cookie."""
    key = request.app[SETTINGS].server.api_key
    if request.method == "POST":
        given = (await request.post()).get("key", "")
        if key is None or hmac.compare_digest(str(given).encode(), key.encode()):
            resp = web.HTTPFound("/ui")
            if key is not None:
                resp.set_cookie(COOKIE, key, httponly=True, samesite="Strict", path="/ui")
            raise resp
        return web.Response(text=LOGIN % "That is not the server's API key.",
                            content_type="text/html", status=401)
    return web.Response(text=LOGIN % "", content_type="text/html")


# ---- JSON ----

async def overview(request: web.Request) -> web.Response:
    app = request.app
    index = await refreshed(app)
    engine, scorer = app[ENGINE], app[SCORER]
    with index.lock:
        steps, events = list(index.steps[-5000:]), list(index.events[-200:])
        evals = list(index.evals[-2000:])
    cache = engine.prefix_cache.health() if engine.prefix_cache is not None else None
    return json_response({
        "model": app[MODEL].model_id, "adapter_version": int(engine.adapter_version),
        "engine": engine.health(),
        "sessions_open": app[SESSIONS].health()["open"],
        "scoring": scorer.health(),  # with the judge's figures: "verdict", "judge"
        "trainer": trainer_state(app),
        "prefix_cache": None if cache is None else {
            k: cache[k] for k in ("lookups", "hits", "misses", "disk_bytes", "memory_bytes")},
        "records": paths.records_size(app[SETTINGS].records.data_dir),  # bytes on disk
        "today": index.today(), "steps": steps, "events": events, "evals": evals,
        "live": list(app[LIVE]),
    })


def trainer_state(app: web.Application) -> dict:
    """/healthz's "trainer" without the journal's figures, in the pages' order, with its state
    (status.py's kind and words, so the dashboard and `rlproxy status` say the same), the eval
    gate's period and the loss's optional terms (a coefficient of 0: the page says "off")."""
    trainer = app.get(TRAINER)
    if trainer is None:
        return {"enabled": False, "state": "off", "state_text": "off", "waiting": None}
    t, settings = trainer_health(app), app[SETTINGS].trainer
    state = status.trainer_state(t, app[SCORER].health())
    remote = {k: t[k] for k in ("url", "run", "remote_step", "sync_error") if k in t}
    return {"enabled": True, "state": state.kind, "state_text": state.words,
            "waiting": state.why, "alive": t["alive"], "error": t["error"],
            "paused": t["paused"], "step": t["step"], "queued": t["queued"],
            "untrained": t["untrained"], "batch_size": t["batch_size"],
            "eval_every": settings.eval_every, "kl_coef": settings.kl_coef,
            "entropy_coef": settings.entropy_coef, "backend": t["backend"], **remote,
            **dataclasses.asdict(trainer.stats)}


async def sessions(request: web.Request) -> web.Response:
    app = request.app
    index = await refreshed(app)
    live = [s.summary() for s in list(app[SESSIONS].open.values())]
    open_ids = {s["id"] for s in live}
    recent = [s for s in index.session_list() if s["id"] not in open_ids]
    recorded = {s["id"]: s for s in index.session_list(only=open_ids)}
    for s in live:
        s.update({k: v for k, v in recorded.get(s["id"], {}).items() if k != "turns"})
    return json_response({"open": live, "recent": recent})


def shorten(text, limit: int = TEXT_LIMIT):
    if isinstance(text, str) and len(text) > limit:
        return text[:limit] + f"… [{len(text) - limit} more characters]"
    return text


def message_view(m: dict) -> dict:
    content = m.get("content")
    if isinstance(content, list):  # content parts: show their text
        content = "\n".join(str(p.get("text", p)) if isinstance(p, dict) else str(p)
                            for p in content)
    return {"role": m.get("role"), "content": shorten(content),
            "tool_calls": m.get("tool_calls")}


def turn_view(r: dict) -> dict:
    choice = r["choices"][r.get("chosen_choice", 0)]
    score = r.get("score") or {}
    trained = r.get("trained")
    return {
        "uid": r["uid"], "index": r.get("index"), "turn_type": r.get("turn_type"),
        "api": r.get("api"), "received": (r.get("timings") or {}).get("received"),
        "first_token_s": (r.get("timings") or {}).get("first_token_s"),
        "prompt_tokens": len(r.get("prompt_ids") or ()),
        "completion_tokens": len(choice.get("completion_ids") or ()),
        "adapter_versions": sorted(set(choice.get("adapter_versions") or ())),
        "prompt_tail": [message_view(m) for m in (r.get("messages") or [])[-2:]],
        "reply": shorten(choice.get("text")), "tool_calls": choice.get("tool_calls") or [],
        "next_state": None if r.get("next_state") is None else [
            message_view(m) for m in r["next_state"]],
        "end": r.get("end"),
        "votes": [{"vote": v.get("vote"), "text": shorten(v.get("text"), 2000),
                   "error": v.get("error")} for v in score.get("votes") or []],
        "hint": score.get("hint"), "judge_reward": score.get("judge_reward"),
        "score_reward": score.get("reward"), "release": r.get("release"),
        "feedback": r.get("feedback"), "skipped": r.get("skipped"),
        "trained": None if trained is None else {"step": trained[0], "time": trained[1]},
    }


def pending_view(t) -> dict:
    """An open turn (its next state not yet here), from the live session: what turn_view shows
    of a recorded one, less the scoring and training it has not had."""
    choice = t.choices[t.chosen_choice]
    return {"uid": t.uid, "index": t.index, "turn_type": t.turn_type, "api": t.api,
            "pending": True, "received": (t.timings or {}).get("received"),
            "prompt_tokens": len(t.prompt_ids or ()),
            "completion_tokens": len(choice.get("completion_ids") or ()),
            "adapter_versions": sorted(set(choice.get("adapter_versions") or ())),
            "reply": shorten(choice.get("text")), "tool_calls": choice.get("tool_calls") or [],
            "prompt_tail": [message_view(m) for m in t.messages[-2:]],
            "next_state": None, "end": "waiting for the next request"}


async def session_detail(request: web.Request) -> web.Response:
    app, sid = request.app, request.match_info["session_id"]
    index = await refreshed(app)
    with index.lock:
        total = len(index.sessions[sid].turns) if sid in index.sessions else 0
    try:  # no start: the latest page, the one a person watching a live session wants
        start = int(request.query.get("start", max(0, total - SESSION_PAGE)))
    except ValueError:
        raise APIError(400, "start must be an integer", param="start") from None
    if start < 0:
        raise APIError(400, "start must be 0 or more", param="start")
    loop = asyncio.get_running_loop()
    records = await loop.run_in_executor(None, index.session_turns, sid, start, SESSION_PAGE)
    turns = [turn_view(r) for r in records]
    live = app[SESSIONS].find(sid)
    seen = {t["uid"] for t in turns}
    open_turns = [t for t in live.pending() if t.uid not in seen] if live is not None else []
    # the open turns are shown on the last page, and counted on every page (the header's total)
    waiting = [pending_view(t) for t in open_turns] if start + SESSION_PAGE >= total else []
    if not turns and not waiting and live is None:
        raise APIError(404, f"no session {sid!r} in the records", param="session_id",
                       code="session_not_found")
    return json_response({"id": sid, "open": live is not None and live.closed is None,
                          "closed": live.closed if live else None, "recorded_turns": total,
                          "pending_turns": len(open_turns), "start": start,
                          "page": SESSION_PAGE, "turns": turns, "waiting": waiting})


def checkpoint_rows(app: web.Application, steps: list[dict]) -> list[dict]:
    rows = []
    for path in paths.complete_checkpoints(app[SETTINGS].records.data_dir / paths.CHECKPOINTS):
        try:
            state = json.loads((path / paths.TRAINER_STATE).read_text())
            step, version = int(state["step"]), state["adapter_version"]
            saved, size = path.stat().st_mtime, (path / "adapters.safetensors").stat().st_size
        except (OSError, ValueError, KeyError, TypeError):
            continue  # pruned while we read, or a damaged state file: not a row to offer
        near = [s for s in steps if s.get("step") is not None and step - 5 < s["step"] <= step]
        rewards = [s["reward_mean"] for s in near if s.get("reward_mean") is not None]
        losses = [s["loss"] for s in near if s.get("loss") is not None]
        rows.append({"step": step, "adapter_version": version, "time": saved,
                     "name": path.name, "bytes": size,
                     "reward_mean": sum(rewards) / len(rewards) if rewards else None,
                     "loss_mean": sum(losses) / len(losses) if losses else None,
                     "window": [near[0]["step"], near[-1]["step"]] if near else None})
    return rows


async def adapters(request: web.Request) -> web.Response:
    app = request.app
    index = await refreshed(app)
    with index.lock:
        steps, events = list(index.steps), list(index.events[-50:])
    rows = await asyncio.get_running_loop().run_in_executor(None, checkpoint_rows, app, steps)
    return json_response({"model": app[MODEL].model_id, "checkpoints": rows,
                          "served_version": int(app[ENGINE].adapter_version),
                          "trainer": trainer_state(app), "events": events})


def add_ui_routes(app: web.Application) -> None:
    app.router.add_get("/ui", page)
    app.router.add_get("/ui/", page)
    app.router.add_get("/ui/static/{name}", static)
    app.router.add_route("*", "/ui/login", login)
    app.router.add_get("/ui/api/overview", overview)
    app.router.add_get("/ui/api/sessions", sessions)
    app.router.add_get("/ui/api/sessions/{session_id}", session_detail)
    app.router.add_get("/ui/api/adapters", adapters)
    # the actions and a checkpoint's download: api/admin.py's add_routes
