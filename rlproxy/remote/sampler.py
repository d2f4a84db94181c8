"""--sampler tinker: the engine's place taken by a Tinker SamplingClient; no local weights.

`TinkerSampler` answers the calls the front doors, /healthz, /metrics and the dashboard make of
serving/engine.py's Engine (`submit`, `cancel`, `stats`, `health()`, `alive`, `error`,
`adapter_version`, `prefix_cache`, `start`/`stop`). A job's prompt ids are sampled on the
service in one `sample` call (temperature, top_p, top_k, seed, max_tokens; stop = the model's
EOS ids), and its tokens are delivered as the engine's Steps once the sample returns, with the
service's own token ids and log-probs. A streamed reply therefore arrives all at once, as many
deltas as tokens.

Weights: the base model's sampling client at first; `publish_sampler(path, version)` (the
remote trainer, after each sync) moves new requests to a client for that
`tinker://RUN/sampler_weights/NAME` path and makes VERSION the adapter version they record.

`SamplingClients` (one ServiceClient and a sampling client per weights path, made on first use
and all dropped after a failure, so the next request starts a fresh session) is shared with
the judge (remote/judge.py).

Failures: a request fails with the service's error as its Step error; after a failure on the
service's side (LearnerUnavailable) `error` names it, so /healthz says what is wrong and new
requests are refused at once (api/turns.py: 503) while a probe asks the service every
PROBE_EVERY_S until it answers again. Nothing here knows HTTP, text or sessions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass

from rlproxy.remote.service import (
    LearnerRefused, LearnerUnavailable, call, refusal, rest_client,
    service_client,
)
from rlproxy.serving.engine import EngineStats
from rlproxy.serving.jobs import Job, Step, Token
from rlproxy.settings import RemoteSettings

log = logging.getLogger("rlproxy.remote")
PROBE_EVERY_S = 2.0  # while the service is failing: how often to ask it again
PROBE_TIMEOUT_S = 10.0  # start-up check and probes: the longest wait for the capabilities
DELIVER_CHUNK = 64  # steps handed over before the reader gets the loop (api's backlog limit)


class SamplingClients:
    """The service's clients, made when first needed (one making at a time) and dropped
    together after a failure. `get(path)` is a SamplingClient of the base model (path None) or
    of saved sampler weights."""

    def __init__(self, r: RemoteSettings, base_model: str):
        self.r, self.base_model, self.timeout = r, base_model, r.tinker_timeout_s
        self.service = None
        self.clients: dict[str | None, object] = {}
        self._making = asyncio.Lock()

    async def get(self, path: str | None):
        if path in self.clients:
            return self.clients[path]
        async with self._making:  # one session and client made at a time, shared by waiters
            if path not in self.clients:
                service = self.service or service_client(self.r)  # no network yet
                made = on_own_thread(lambda: _sampling_client(service, path, self.base_model,
                                                              self.timeout))
                client = await bounded(asyncio.wrap_future(made), self.timeout,
                                       f"a sampling client for {path or self.base_model}")
                self.service, self.clients[path] = service, client
            return self.clients[path]

    def drop(self, status: str = "errored") -> None:
        """After a failure, and at shutdown: the next request makes a new session. The old one
        is closed in the background, which also ends its heartbeats (they would log a warning
        every 10 s for as long as the process lives)."""
        service, self.service, self.clients = self.service, None, {}
        if service is not None:  # on a thread of its own: the SDK may wait for a dead service
            threading.Thread(target=_close, args=(service, status), daemon=True,
                             name="rlproxy-tinker-close").start()

    async def sample(self, path: str | None, ids: list[int], params, *, topk: int = 0,
                     prompt_logprobs: bool = False):
        """One SampleResponse for IDS, or LearnerRefused / LearnerUnavailable. A refusal from
        a client made before this call is tried once more on fresh ones: the service may have
        restarted and forgotten its sessions."""
        from tinker import types

        for attempt in (0, 1):
            fresh = path not in self.clients
            try:
                client = await self.get(path)
                fut = client.sample(prompt=types.ModelInput.from_ints(ids), num_samples=1,
                                    sampling_params=params, topk_sample_logprobs=topk,
                                    include_prompt_logprobs=prompt_logprobs)
                return await bounded(asyncio.wrap_future(fut.future()), self.timeout,
                                     "sample", cancel=fut.future().cancel)
            except (LearnerRefused, LearnerUnavailable) as e:
                self.drop()
                if isinstance(e, LearnerUnavailable) or fresh or attempt:
                    raise


def _close(service, status: str) -> None:
    try:
        service.close(status).result(timeout=PROBE_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001  (a dead service or a session never opened)
        log.debug("closing a Tinker session: %s", e)


def _sampling_client(service, path: str | None, base_model: str, timeout: float):
    made = (service.create_sampling_client(base_model=base_model) if path is None
            else service.create_sampling_client(model_path=path))
    return made.result(timeout=timeout)


def on_own_thread(fn) -> concurrent.futures.Future:
    """fn() on a daemon thread of its own. The SDK makes a session synchronously, retrying a
    service that is down for minutes; a pool thread left waiting there would hold up the
    process's exit (concurrent.futures joins its threads), a daemon thread does not."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        if fut.set_running_or_notify_cancel():
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001  (handed to the waiter)
                fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name="rlproxy-tinker-call").start()
    return fut


async def bounded(awaitable, timeout: float, what: str, cancel=lambda: None):
    """AWAITABLE's result within TIMEOUT, failing as service.call fails (LearnerRefused when
    the caller is wrong, LearnerUnavailable otherwise); CANCEL stops it on the SDK's side."""
    try:
        async with asyncio.timeout(timeout):
            return await awaitable
    except TimeoutError:
        cancel()
        raise LearnerUnavailable(f"{what}: no answer from the Tinker service in {timeout:g} s")
    except asyncio.CancelledError:
        cancel()
        raise
    except (LearnerRefused, LearnerUnavailable):
        raise
    except Exception as e:  # worded as service.call words it
        said = refusal(e)
        if said is not None:
            raise LearnerRefused(f"{what}: {said}") from None
        raise LearnerUnavailable(f"{what}: {type(e).__name__}: {str(e)[:500]}") from None


@dataclass
class ServiceState:
    """Whether the service answered last, for /healthz; `error` is set while it does not."""

    error: str | None = None
    since: float | None = None
    failures: int = 0
    last_ok: float | None = None


class TinkerSampler:
    """Engine's interface on a Tinker service. Entry points are thread-safe."""

    model = None  # no local weights
    prefix_cache = None  # KV lives on the service

    def __init__(self, r: RemoteSettings, base_model: str, eos_token_ids, *, max_batch: int):
        self.r, self.base_model = r, base_model
        self.eos_token_ids = sorted(eos_token_ids)
        self.max_batch = max_batch  # the front doors' view; the service batches on its side
        self.adapter_version = 0
        self.model_path: str | None = None  # None: the base model
        self.stats = EngineStats()
        self.service = ServiceState()
        self.clients = SamplingClients(r, base_model)
        self.url = r.tinker_url or "the tinker SDK's default"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: dict[int, object] = {}  # id(job) -> its task's future
        self._probe: asyncio.Task | None = None

    # ---- start-up ----

    def check(self) -> int | None:
        """The key is accepted and the service has the base model, else LearnerRefused (a
        ValueError: the CLI prints it as one line and exits 2). A service that does not answer
        is not a start-up error: serving starts and requests fail until it does. Returns the
        service's context length for the base model, when it says."""
        try:
            return self._capabilities()
        except LearnerRefused as e:
            raise LearnerRefused(f"--sampler tinker: {e}") from None
        except LearnerUnavailable as e:
            log.warning("the Tinker service at %s does not answer (%s); serving starts, and "
                        "requests fail until it does", self.url, e)
            self._failed(str(e))
            return None

    def _capabilities(self) -> int | None:
        timeout = min(self.r.tinker_timeout_s, PROBE_TIMEOUT_S)

        def ask():
            os.environ.setdefault("TINKER_TELEMETRY", "0")  # as service_client does
            rest = rest_client(self.r)
            return rest.get_server_capabilities().result(timeout=timeout)
        caps = call(ask, timeout, "server capabilities")
        models = {m.model_name: m for m in caps.supported_models}
        if self.base_model not in models:
            raise LearnerRefused(f"the Tinker service has no base model {self.base_model!r} "
                                 f"(it has {', '.join(models) or 'none'}): set "
                                 "--tinker-base-model, or --served-model-name to its name")
        return models[self.base_model].max_context_length

    # ---- Engine's entry points ----

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.service.error is not None:
            self._probe = self._loop.create_task(self._probe_until_back())

    def stop(self) -> None:
        for fut in list(self._running.values()):
            fut.cancel()
        self.clients.drop("success")
        if self._probe is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._probe.cancel)

    @property
    def alive(self) -> bool:
        return self._loop is not None and not self._loop.is_closed()

    @property
    def error(self) -> str | None:
        """Set while the service is failing: /healthz reports it, new requests get a 503."""
        e = self.service.error
        return None if e is None else f"the Tinker service at {self.url} is unavailable: {e}"

    def busy(self) -> bool:
        return self.stats.active > 0

    def submit(self, job: Job) -> Job:
        if job.params.seed is None:
            job.params.seed = secrets.randbits(31)  # reported back, so the run can be redone
        self.stats.requests += 1
        self._running[id(job)] = asyncio.run_coroutine_threadsafe(self._run(job), self._loop)
        return job

    def cancel(self, job: Job) -> None:
        fut = self._running.pop(id(job), None)
        if fut is not None:
            fut.cancel()
        job.done = True

    def publish_sampler(self, path: str, version: int) -> None:
        """New requests sample from the sampler weights at PATH (tinker://RUN/sampler_weights/
        NAME) and record VERSION; the client for them is made now, in the background."""
        self.model_path, self.adapter_version = path, version
        self.stats.swaps += 1
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._warm(path), self._loop)

    def health(self) -> dict:
        s = self.service
        return {**asdict(self.stats), "backend": "tinker", "url": self.url,
                "base_model": self.base_model, "model_path": self.model_path,
                "service_error": s.error, "failing_since": s.since,
                "service_failures": s.failures, "last_sample_at": s.last_ok}

    # ---- on the event loop ----

    async def _run(self, job: Job) -> None:
        path, version = self.model_path, self.adapter_version
        self.stats.active += 1
        try:
            reply = await self.clients.sample(path, job.prompt_ids, self._params(job),
                                              topk=job.params.top_logprobs)
            steps = self._steps(reply.sequences[0], version, job.params.top_logprobs)
            self.service.error, self.service.last_ok = None, time.time()
        except asyncio.CancelledError:
            raise
        except (LearnerRefused, LearnerUnavailable) as e:
            if isinstance(e, LearnerUnavailable):
                self._failed(str(e))
            steps = [Step(finish_reason="error", error=str(e),
                          status=503 if isinstance(e, LearnerUnavailable) else 400)]
        except Exception as e:  # a bug here fails this request, not the server
            log.exception("sampling on the Tinker service failed")
            steps = [Step(finish_reason="error", error=f"{type(e).__name__}: {e}")]
        finally:
            self.stats.active -= 1
            self._running.pop(id(job), None)
        if job.done:  # cancelled while the sample was out
            return
        self.stats.steps += 1
        for i, step in enumerate(steps):
            if step.finish_reason is not None:
                job.done = True
            self.stats.tokens += step.token is not None
            job.deliver(step)
            if (i + 1) % DELIVER_CHUNK == 0:
                await asyncio.sleep(0.001)  # the reader takes what came (no backlog cut-off)
                if job.done:
                    return

    def _params(self, job: Job):
        from tinker import types

        p = job.params
        unsupported = [name for name, on in (
            ("logit_bias", p.logit_bias), ("presence_penalty", p.presence_penalty),
            ("frequency_penalty", p.frequency_penalty)) if on]
        if unsupported:
            raise LearnerRefused(f"{', '.join(unsupported)} cannot be applied with --sampler "
                                 "tinker: the Tinker API samples without them")
        if job.adapter is not None:
            raise LearnerRefused("named adapters are served by a local engine only")
        return types.SamplingParams(max_tokens=p.max_tokens, seed=p.seed,
                                    temperature=p.temperature, top_p=p.top_p,
                                    top_k=p.top_k or -1, stop=list(self.eos_token_ids))

    def _steps(self, seq, version: int, top_k: int) -> list[Step]:
        tokens, logprobs = list(seq.tokens), list(seq.logprobs or [])
        if len(logprobs) != len(tokens):
            raise LearnerUnavailable(f"the service returned {len(tokens)} tokens with "
                                     f"{len(logprobs)} log-probs")
        top = None
        if top_k and seq.topk_logprobs_np is not None:
            ids, lps = seq.topk_logprobs_np.token_ids, seq.topk_logprobs_np.logprobs
            top = [list(zip(map(int, ids[i][:top_k]), map(float, lps[i][:top_k])))
                   for i in range(len(tokens))]
        end = "stop" if seq.stop_reason == "stop" else "length"
        steps = [Step(token=Token(int(t), float(lp), version, top[i] if top else None))
                 for i, (t, lp) in enumerate(zip(tokens, logprobs))]
        if steps:
            steps[-1].finish_reason = end
        else:
            steps = [Step(finish_reason=end)]
        return steps

    async def _warm(self, path: str) -> None:
        try:
            await self.clients.get(path)
        except (LearnerRefused, LearnerUnavailable) as e:  # requests say it when they come
            log.warning("sampler weights %s: %s", path, e)

    def _failed(self, message: str) -> None:
        s = self.service
        if s.error is None:
            s.since = time.time()
            log.warning("the Tinker service at %s is failing: %s", self.url, message)
        s.error, s.failures = message, s.failures + 1
        if self._loop is not None and (self._probe is None or self._probe.done()):
            self._loop.call_soon_threadsafe(self._start_probe)

    def _start_probe(self) -> None:
        if self._probe is None or self._probe.done():
            self._probe = self._loop.create_task(self._probe_until_back())

    async def _probe_until_back(self) -> None:
        """Ask the service for its capabilities until it answers; then requests go through."""
        loop = asyncio.get_running_loop()
        while self.service.error is not None:
            await asyncio.sleep(PROBE_EVERY_S)
            try:
                await loop.run_in_executor(None, self._capabilities)
            except (LearnerUnavailable, LearnerRefused) as e:  # refused: a key revoked meanwhile
                self.service.error = str(e)
                continue
            log.info("the Tinker service at %s answers again", self.url)
            self.service.error, self.service.since = None, None
