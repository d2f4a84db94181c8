"""The learning path, wired in one place: session store → scorer → trainer.

A finished main turn goes from the session store to the scorer (`on_trainable`, and
`on_closed` when its session ends); a scored item that the scorer releases goes to the
trainer (`on_released`); the trainer publishes adapters to the engine. Each part is built with
its sink, so `build_pipeline` reads top to bottom as that sentence does (built back to front:
a sink exists before what feeds it). `pipeline_context` starts and stops the three in one
place, in an order written out below rather than implied by the app's cleanup contexts. What
each part starts from is read from the records once, by `recover` (recovery.py), after the
trainer (which reads its own files) says which keys it has handled.

The default adapter has one such pipeline on the data dir; each personal adapter (`MODEL:NAME`,
X-RL-Adapter) has one of its own on <data_dir>/adapters/NAME/, sharing the judges, the base
weights and the engine's batch, its trainer taking steps in turn with the others (`Adapters`:
made on first use, let go of when idle, made again from disk).

Owns no behaviour of its own beyond that wiring and the personal adapters' lifecycle: the store,
the scorer and the trainer are in sessions/, scoring/ and training/; the engine and the model it
is given are built by app.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from rlproxy.appkeys import ADAPTERS, ADAPTERS_OFF, DRAINING, ENGINE, MODEL, OUTLIVES, RANKS, \
    SCORER, SESSIONS, TRAINER
from rlproxy.ops.progress import phase
from rlproxy.remote.judge import TINKER, TinkerJudge
from rlproxy.remote.learner import remote_learner
from rlproxy.remote.service import base_model_name
from rlproxy.scoring.judges import LocalJudge, RemoteJudge
from rlproxy.scoring.scorer import Scorer
from rlproxy.serving.engine import Engine
from rlproxy.serving.model import LoadedModel, load_base_model
from rlproxy.sessions.store import SessionStore, sweep_idle_forever
from rlproxy.mlx_threads import Worker
from rlproxy.protocol import APIError
from rlproxy.serving.personal import PersonalAdapter, training_model
from rlproxy.settings import Settings, adapter_name
from rlproxy.paths import ADAPTERS as ADAPTERS_DIR, CHECKPOINTS, RANK0_LOG, TRAINER_STATE, \
    complete_checkpoints
from rlproxy.compaction import compact
from rlproxy.recovery import recover, trainer_start
from rlproxy.training import distributed
from rlproxy.training.rank_link import Link
from rlproxy.training.learner import training_copy
from rlproxy.training.loop import Trainer
from rlproxy.training.pacing import StepTurns
from rlproxy.training.restart import TrainerStart

log = logging.getLogger("rlproxy")


@dataclass
class Pipeline:
    store: SessionStore
    scorer: Scorer
    trainer: Trainer | None  # None with --no-train: released items go nowhere
    judges: list = field(default_factory=list)  # the judge/teacher backends, closed last


def build_pipeline(settings: Settings, model: LoadedModel, engine: Engine,
                   ranks: Link | None = None, shared: Pipeline | None = None,
                   adapter: PersonalAdapter | None = None,
                   turns: StepTurns | None = None) -> Pipeline:
    """SHARED: the default adapter's pipeline, whose judges (and KL reference) a personal
    adapter's uses too, owned by it; ADAPTER: the personal adapter's place in the engine, which
    its trainer publishes to; TURNS: the trainers' one step at a time."""
    if shared is None:
        judge, teacher, judges = make_judges(settings, model, engine)
    else:
        judge, teacher, judges = shared.scorer.judge, shared.scorer.teacher, []
    # the judge model's name: its calibration's key in verdict.json
    judge_name = (base_model_name(settings, model) if isinstance(judge, TinkerJudge)
                  else settings.scoring.judge_model if isinstance(judge, RemoteJudge)
                  else settings.model.model)
    data_dir = settings.records.data_dir
    trainer = scorer = None
    if settings.records.compact_records:  # before anything reads the records
        done = compact(data_dir, settings)
        if done["turns"]:
            log.info("compacted the records: %d turns of %d closed, trained sessions moved to "
                     "%s", done["turns"], done["sessions"], done["segment"])
    try:
        ref = (shared.trainer.learner.ref_model
               if shared is not None and shared.trainer is not None else None)
        trainer = (make_trainer(settings, model, engine, ranks, trainer_start(data_dir),
                                adapter=adapter, turns=turns, ref=ref)
                   if settings.trainer.train else None)
        # every record file read once, for what each part starts from (recovery.py)
        handled = trained_or_quarantined(trainer) if trainer is not None else None
        state = recover(data_dir, settings, handled)
        if trainer is not None:
            # released before a restart but not trained yet: train them now (the trainer has
            # read its journal: quarantined turns stay out, a crashed step's turns come back
            # alone)
            for scored in state.trainer.released:
                trainer.submit(scored)
        # a released item goes to the trainer (a thread-safe submit)
        scorer = Scorer(settings.scoring, data_dir, judge, teacher, model.tokenizer,
                        state.scorer, fsync=settings.records.fsync,
                        baseline=settings.trainer.baseline, judge_name=judge_name,
                        on_released=trainer.submit if trainer is not None else None)
        # a finished main turn goes to the scorer; a closed session tells it no next state comes
        store = SessionStore(data_dir, settings.sessions.session_idle_timeout_s,
                             fsync=settings.records.fsync, on_trainable=scorer.submit,
                             on_closed=scorer.session_closed,
                             max_open_sessions=settings.sessions.max_open_sessions,
                             train_sessions_matching=settings.sessions.train_sessions_matching,
                             start=state.store, extend_turns=settings.records.extend_turns)
    except BaseException:  # what was built closes its files and threads before the error goes up
        if trainer is not None:
            trainer.stop()
        if scorer is not None:
            scorer.close()
        for backend in judges:
            if isinstance(backend, LocalJudge):
                backend.close()
        raise
    return Pipeline(store, scorer, trainer, judges)


def make_judges(settings: Settings, model: LoadedModel, engine: Engine):
    """(judge, teacher, every backend made): the Tinker service's base model (`tinker`, the
    default with --sampler tinker, which has no local weights), a remote server, or a local
    base-model copy. The judge backend answers votes and OPD's hints; the teacher, log-probs."""
    s = settings.scoring
    default = TINKER if settings.remote.sampler == "tinker" else None
    judge_url, teacher_url = s.judge_url or default, s.teacher_url or default
    wanted = [(judge_url, (s.judge and s.method != "opd") or s.method != "rl"),
              (teacher_url, s.method != "rl")]
    local = remote = service = None
    if any(url is None and used for url, used in wanted):
        # a second, adapter-free copy of the base model, on its own thread
        with phase("loaded the judge's base model"):
            base, tokenizer = load_base_model(settings.model)
        local = LocalJudge(base, tokenizer, busy=lambda: engine.stats.active > 0,
                           yield_ms=s.judge_yield_ms)
    if any(url == TINKER and used for url, used in wanted):
        service = TinkerJudge(settings.remote, base_model_name(settings, model), model.tokenizer)
    http_judge, http_teacher = (u if u != TINKER else None for u in (judge_url, teacher_url))
    if http_judge or http_teacher:
        remote = RemoteJudge(http_judge or http_teacher, s.judge_model, s.judge_api_key,
                             s.judge_timeout_s, s.judge_retries, teacher_url=http_teacher)

    def backend(url):
        return service if url == TINKER else remote if url else local

    return backend(judge_url), backend(teacher_url), [
        b for b in (service, remote, local) if b is not None]


def make_trainer(settings: Settings, loaded: LoadedModel, engine: Engine,
                 ranks: Link | None = None, start: TrainerStart | None = None,
                 adapter: PersonalAdapter | None = None, turns: StepTurns | None = None,
                 ref=None) -> Trainer:
    """START: the trainer's records as recovery.py read them (None: read them now). ADAPTER:
    a personal adapter's trainer: a fresh LoRA of its own, published to ADAPTER; REF: the KL
    reference model when one is loaded already."""
    with phase("made the trainer's model"):  # no local weights with --sampler tinker
        model = (None if loaded.model is None else training_copy(loaded) if adapter is None
                 else training_model(loaded, settings.trainer.train_seed))
    learner = None  # the local one; --trainer tinker: a Tinker service's (remote/learner.py)
    if settings.remote.trainer == "tinker":
        with phase("joined the Tinker run"):
            learner = remote_learner(settings, loaded, model)
    if ref is None and settings.trainer.kl_coef > 0:
        ref = load_base_model(settings.model)[0]
    trainer = Trainer(settings, model, loaded.lora_config, adapter or engine, ref_model=ref,
                      vocab_size=loaded.vocab_size, tokenizer=loaded.tokenizer, learner=learner,
                      ranks=ranks, start=start, turns=turns)
    try:
        trainer.resume()
        if learner is not None:  # serve the run's newest weights (another replica's steps)
            trainer.sync_now()
    except BaseException:
        trainer.stop()  # its journal and record writers
        raise
    return trainer


def trained_or_quarantined(trainer: Trainer) -> set[str]:
    """Keys the trainer will not take again: trained (training.jsonl, less the steps a resume
    redoes) or quarantined. Its journal quarantined every key whose attempts are spent when it
    was read (training/journal.py), so this is what `released_turns` skips, without reading
    the two files again."""
    return set(trainer.trained) | set(trainer.journal.quarantined)


def ranks_context(settings: Settings):
    """Under mlx.launch with several ranks: rank 0's link to the gradient workers (for the
    trainer and the Tinker API's training), up first and down last; SIGTERM asks it whether a
    rank failed (api/server.py)."""
    async def ctx(app: web.Application):
        link = distributed.join(settings)  # start-up: nothing is served yet
        if link is not None:
            app[RANKS] = link
            app[OUTLIVES] = functools.partial(distributed.outlive, link,
                                              settings.records.data_dir / RANK0_LOG)
        yield
        if link is not None:
            await asyncio.get_running_loop().run_in_executor(None, distributed.leave, link)

    return ctx


async def stop_when(draining: asyncio.Event, trainers) -> None:
    await draining.wait()
    for trainer in trainers():
        trainer.request_stop()


@dataclass
class Running:
    """A pipeline while it serves: its scorer's worker and its store's idle sweep."""
    pipeline: Pipeline
    tasks: list[asyncio.Task]


def start(p: Pipeline) -> Running:
    if p.trainer is not None:
        p.trainer.start()
    return Running(p, [asyncio.create_task(p.scorer.run()),
                       asyncio.create_task(sweep_idle_forever(p.store))])


async def stop(r: Running) -> None:
    """In the order the work flows: the store files its last turns, the trainer ends its step
    at its next unit, uncharged, and saves (the scorer may still release meanwhile: a restart
    trains what the stopped trainer did not), then the scorer and the judges it called."""
    loop, p = asyncio.get_running_loop(), r.pipeline
    scoring, sweeper = r.tasks
    sweeper.cancel()
    await asyncio.gather(sweeper, return_exceptions=True)
    await loop.run_in_executor(None, p.store.close)  # joins the writer threads
    if p.trainer is not None:
        await loop.run_in_executor(None, p.trainer.stop)
    scoring.cancel()
    await asyncio.gather(scoring, return_exceptions=True)
    await loop.run_in_executor(None, p.scorer.close)
    for backend in p.judges:
        if isinstance(backend, RemoteJudge):
            await backend.close()
        else:
            await loop.run_in_executor(None, backend.close)


@dataclass
class Personal:
    """A personal adapter: its pipeline over <data_dir>/adapters/NAME/ and its place in the
    engine."""
    name: str
    running: Running
    served: PersonalAdapter
    used: float = field(default_factory=time.monotonic)  # its last request began
    requests: int = 0  # its requests in flight (api/turns.py): never let go of meanwhile

    @property
    def pipeline(self) -> Pipeline:
        return self.running.pipeline

    @property
    def data_dir(self) -> Path:
        return self.pipeline.store.data_dir


class Adapters:
    """The personal adapters, the one owner of them: each is a pipeline of its own (store ->
    scorer -> trainer, on its own folder: records, checkpoints, journals), whose trainer
    publishes to its named place in the engine (serving/personal.py) and takes its steps in turn
    with the others (training/pacing.py `StepTurns`). Judges, the model's base arrays and the
    engine's batch are shared. Its own folder, not tags on shared files: every reader (start-up
    recovery, `rlproxy train --from`, export, `records tail`, the dashboard's record index)
    works on one adapter's folder as on a data dir, a turn of one adapter cannot reach
    another's trainer, and an adapter is removed by removing its folder.

    An adapter is made on a worker thread of its own (its records read, its model built, its
    checkpoint loaded: MLX work off the event loop); requests for a name being made wait for
    that one making. One that cannot be made (an unreadable folder, a checkpoint of another
    layout) is logged and its requests get 503; the server and the other adapters go on.
    Event loop only."""

    def __init__(self, settings: Settings, model: LoadedModel, engine: Engine,
                 default: Pipeline, turns: StepTurns):
        self.settings, self.model, self.engine = settings, model, engine
        self.default, self.turns = default, turns
        self.by_name: dict[str, Personal] = {}
        self.making: dict[str, asyncio.Future] = {}
        self.failed: dict[str, str] = {}  # name -> why it could not be made (its requests: 503)
        # on disk, not loaded: made by an earlier run and not asked for since this one
        # started, or let go of after --adapter-idle-s; the next request brings it back
        self.resting: set[str] = set()
        # being let go of: its pipeline still stopping (files being written); a request for it
        # waits for that before making it again on the same folder
        self.stopping: dict[str, asyncio.Future] = {}
        self.root = settings.records.data_dir / ADAPTERS_DIR
        self._worker: Worker | None = None

    def on_disk(self) -> list[str]:
        """The adapters with a folder of records (made by an earlier run)."""
        if not self.root.is_dir():
            return []
        names = []
        for path in sorted(self.root.iterdir()):
            try:
                if path.is_dir() and adapter_name(path.name) == path.name:
                    names.append(path.name)
            except ValueError:
                log.warning("%s is not an adapter's folder (not an adapter name): left alone",
                            path)
        return names

    def on_disk_only(self, name: str) -> bool:
        """NAME rests on disk, or is being let go of: a request for it makes it again."""
        return name in self.resting or name in self.stopping

    def find(self, name: str, param: str) -> Personal | None:
        """NAME's adapter if it is made, else None, without making it; 503 if it failed."""
        if name in self.failed:
            raise APIError(503, f"adapter '{name}' could not be started: {self.failed[name]}",
                           type="server_error", param=param, code="adapter_unavailable")
        return self.by_name.get(name)

    async def get(self, name: str, param: str) -> Personal:
        """NAME's adapter, made now when it is new: 404 with --adapter-names fixed, 403 past
        --max-adapters (PARAM: where the request named it)."""
        if (personal := self.find(name, param)) is not None:
            return personal
        if name in self.stopping:
            await asyncio.shield(self.stopping[name])
        if name not in self.making and name not in self.resting:
            s = self.settings.sessions
            if s.adapter_names == "fixed":
                raise APIError(404, f"no adapter named '{name}' (--adapter-names fixed)",
                               param=param, code="adapter_not_found")
            known = {*self.by_name, *self.making, *self.failed, *self.resting, *self.stopping}
            if len(known) >= s.max_adapters:  # a name being made again counts once
                raise APIError(403, f"cannot make adapter '{name}': --max-adapters "
                               f"{s.max_adapters} exist already", param=param,
                               code="adapter_limit")
        await asyncio.shield(self.make(name))
        if (personal := self.find(name, param)) is None:
            raise APIError(503, f"adapter '{name}' was stopped", type="server_error",
                           param=param, code="adapter_unavailable")
        return personal

    def make(self, name: str) -> asyncio.Future:
        """NAME's making, started now unless one is under way; done once it is made or failed
        (`failed` says why)."""
        if name in self.making:
            return self.making[name]
        done = self.making[name] = asyncio.ensure_future(self._make(name))
        done.add_done_callback(lambda _: self.making.pop(name, None))
        return done

    async def _make(self, name: str) -> None:
        data_dir = self.root / name
        created = not data_dir.exists()
        settings = self.settings.model_copy(deep=True)
        settings.records.data_dir = data_dir
        served = PersonalAdapter(self.engine, self.model, f"adapter:{name}")
        if self._worker is None:
            self._worker = Worker("rlproxy-adapters-made")

        def build() -> Pipeline:
            data_dir.mkdir(parents=True, exist_ok=True)
            newest = complete_checkpoints(data_dir / CHECKPOINTS)[-1:]
            if newest and not settings.trainer.train:  # no trainer to resume: served as is
                state = json.loads((newest[0] / TRAINER_STATE).read_text())
                served.publish_saved(newest[0], int(state.get("adapter_version", 0)))
            else:  # the base until its trainer publishes or resumes
                served.publish_adapter({}, 0)
            return build_pipeline(settings, self.model, self.engine, shared=self.default,
                                  adapter=served, turns=self.turns)

        try:
            p = await asyncio.wrap_future(self._worker.run(build))
        except Exception as e:  # this adapter is out of service; the others and the server not
            served.drop()
            log.error("adapter %s could not be started from %s: %s: %s", name, data_dir,
                      type(e).__name__, e)
            self.failed[name] = f"{type(e).__name__}: {e}"
            self.resting.discard(name)
            if created:  # made by this attempt and left empty: not an adapter after a restart
                with contextlib.suppress(OSError):
                    data_dir.rmdir()
            return
        self.resting.discard(name)
        self.by_name[name] = Personal(name, start(p), served)
        log.info("adapter %s: serving version %d from %s", name, served.adapter_version,
                 data_dir)

    async def rest_idle(self) -> None:
        """Let go of every adapter without a request for --adapter-idle-s: its pipeline stops
        as at shutdown (the trainer saves weights and optimizer; turns waiting for their next
        state stay in its journal) and the engine drops it; its next request makes it again,
        from disk. Never one with a request in flight."""
        idle_s = self.settings.sessions.adapter_idle_s
        t = self.settings.trainer
        if t.train and not t.resume:  # made again, it would start fresh: kept loaded
            return
        now = time.monotonic()
        for personal in list(self.by_name.values()):
            trainer = personal.pipeline.trainer
            if personal.requests or now - personal.used < idle_s or (
                    trainer is not None and trainer.paused):  # a pause lives in memory only
                continue
            del self.by_name[personal.name]  # no request finds it from here on
            if trainer is not None:
                trainer.request_stop()
            # a task of its own: a shutdown that cancels this sweep does not cut the stop short
            # (the trainer's last save, the scorer's last lines); `close` waits for it
            letting_go = self.stopping[personal.name] = asyncio.ensure_future(
                self._let_go(personal))
            await asyncio.shield(letting_go)
            log.info("adapter %s: idle for %.0f s, saved and let go of (its next request "
                     "brings it back)", personal.name, now - personal.used)

    async def _let_go(self, personal: Personal) -> None:
        try:
            await stop(personal.running)
        except Exception:
            log.exception("adapter %s did not stop cleanly", personal.name)
        finally:
            personal.served.drop()
            self.resting.add(personal.name)
            del self.stopping[personal.name]

    def trainers(self) -> list[Trainer]:
        return [a.pipeline.trainer for a in self.by_name.values()
                if a.pipeline.trainer is not None]

    async def close(self) -> None:
        """Every adapter stopped (the makings under way first), each on its own: one that
        fails to stop does not keep the others running."""
        for pending in [*self.making.values(), *self.stopping.values()]:
            with contextlib.suppress(BaseException):
                await pending
        for trainer in self.trainers():  # all at once: none waits for another's turn
            trainer.request_stop()
        for personal in list(self.by_name.values()):
            try:
                await stop(personal.running)
            except Exception:
                log.exception("adapter %s did not stop cleanly", personal.name)
            personal.served.drop()
        self.by_name.clear()
        if self._worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._worker.stop)

    def health(self) -> dict:
        """/healthz's "adapters": each personal adapter's sessions, version and training."""
        out = {}
        for name, a in self.by_name.items():
            t = a.pipeline.trainer
            out[name] = {"version": a.served.adapter_version,
                         "sessions_open": a.pipeline.store.health()["open"],
                         "data_dir": str(a.data_dir),
                         "trainer": None if t is None else {
                             "step": t.step, "alive": t.alive, "error": t.error,
                             "untrained": len(t.books.queued), "paused": t.paused,
                             "optimizer_steps": t.stats.optimizer_steps,
                             "turns_trained": t.stats.turns_trained}}
        return {"max_adapters": self.settings.sessions.max_adapters,
                "names": self.settings.sessions.adapter_names, "adapters": out,
                "resting": sorted(self.resting), "failed": dict(self.failed)}


async def rest_idle_forever(adapters: Adapters) -> None:
    every = min(60.0, max(0.5, adapters.settings.sessions.adapter_idle_s / 4))
    while True:
        await asyncio.sleep(every)
        try:
            await adapters.rest_idle()
        except Exception:  # the next round tries again; serving is not touched
            log.exception("letting idle adapters go failed")


def personal_adapters_off(settings: Settings, ranks: Link | None) -> str | None:
    """Why this server has no personal adapters, or None."""
    if settings.sessions.max_adapters == 0 and not settings.sessions.adapters:
        return "--max-adapters 0"
    if "tinker" in (settings.remote.trainer, settings.remote.sampler):
        return "a learner or sampler elsewhere (--trainer/--sampler tinker)"
    if ranks is not None:
        return "training on several ranks (mlx.launch)"
    return None


def pipeline_context(settings: Settings):
    async def ctx(app: web.Application):
        p = build_pipeline(settings, app[MODEL], app[ENGINE], app.get(RANKS),
                           turns=(turns := StepTurns()))
        if p.trainer is not None:
            app[TRAINER] = p.trainer
        app[SCORER], app[SESSIONS] = p.scorer, p.store
        default = start(p)
        adapters = None
        if (off := personal_adapters_off(settings, app.get(RANKS))) is None:
            adapters = app[ADAPTERS] = Adapters(settings, app[MODEL], app[ENGINE], p, turns)
        else:
            app[ADAPTERS_OFF] = off
            if settings.sessions.adapters:
                log.warning("--adapters %s: not made, personal adapters are off here (%s)",
                            ",".join(settings.sessions.adapters), off)

        def trainers():
            return ([p.trainer] if p.trainer is not None else []) + (
                adapters.trainers() if adapters is not None else [])

        # SIGTERM: the trainers' steps end at their next unit while requests drain
        # (api/server.py)
        stopper = asyncio.create_task(stop_when(app[DRAINING], trainers))
        idle = None
        try:
            if adapters is not None:
                # those with records from an earlier run rest on disk until asked for
                adapters.resting.update(adapters.on_disk())
                for name in settings.sessions.adapters:  # named at start-up: made now
                    with phase(f"made adapter {name}"):
                        await adapters.make(name)  # one that fails is logged, and serves 503
                if settings.sessions.adapter_idle_s > 0:
                    idle = asyncio.create_task(rest_idle_forever(adapters))
            yield
        finally:
            stopper.cancel()
            if idle is not None:
                idle.cancel()
            await asyncio.gather(stopper, *([idle] if idle is not None else []),
                                 return_exceptions=True)
            for trainer in trainers():  # every step ends at its next unit, at once
                trainer.request_stop()
            try:
                if adapters is not None:  # theirs first: they share the default's judges
                    await adapters.close()
            finally:
                await stop(default)

    return ctx
