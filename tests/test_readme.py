"""The README's first screen, followed as a new user would: its commands run as written in a
fresh virtual environment and a fresh home, the server it starts answers the request it shows
with the answer it promises, and its test command is the one CI runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from rlproxy.ops.served import free_port, wait_healthy
from rlproxy.serving.model_fetch import model_cache_dir

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"


def first_screen() -> tuple[list[str], str, str]:
    """(the code blocks of the README's first screen, the text around them, the answer promised
    after the request block)."""
    text = README.read_text().split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    promised = re.search(r"```\n\nanswers `([^`]+)`", text)
    assert promised, "the first screen says what the request answers"
    return blocks, text, promised[1]


def test_the_first_screen_has_setup_serve_request_and_ci_test_command():
    blocks, text, _ = first_screen()
    assert len(blocks) == 3, blocks
    setup, test = blocks[0].splitlines(), blocks[2].strip()
    assert setup[0].startswith("sudo apt-get install") and "optional" in text  # before, said so
    assert setup[-1].endswith("rlproxy serve")
    ci = (REPO / ".ci" / "run").read_text()
    for command in test.split(" && "):  # CI runs exactly these
        assert f"\n{command}\n" in ci, command
    assert "python3 -m venv" in text  # the hint for a system Python that refuses pip


PIP_SOURCES = {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT",
               "PIP_TRUSTED_HOST", "PIP_DEFAULT_TIMEOUT", "PIP_CACHE_DIR"}


def fresh_venv(tmp_path: Path) -> Path:
    """A new virtual environment with pip: the standard library's, or virtualenv's where the
    system Python has no ensurepip (Debian without python3-venv)."""
    venv = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        tools = tmp_path / "virtualenv"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", str(tools),
                        "virtualenv"], check=True)
        subprocess.run([sys.executable, "-m", "virtualenv", str(venv)], check=True,
                       env={**os.environ, "PYTHONPATH": str(tools)})
    return venv


@pytest.mark.slow
@pytest.mark.real_model
def test_the_first_screen_serves_its_answer_from_a_fresh_venv(tmp_path):
    blocks, _, promised = first_screen()
    serve_line = blocks[0].splitlines()[-1]  # the apt line: CI's own set-up ran it as root
    venv, home, log = fresh_venv(tmp_path), tmp_path / "home", tmp_path / "serve.log"
    home.mkdir()
    port = free_port()
    # pip's settings for where packages come from stay (a machine's index, wheelhouse, CA); the
    # rest of PIP_* (--user, --target, ...) would not be a new user's
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RLPROXY_", "VIRTUAL_ENV", "PYTHON", "PIP_")) or k in PIP_SOURCES}
    env.update(PATH=f"{venv / 'bin'}:{env['PATH']}", HOME=str(home), PYTHONUNBUFFERED="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_COMPILE="1",  # no .pyc made for every file of every package at install:
                                    # Python compiles what it imports
               RLPROXY_PORT=str(port),  # the README's 8000 may be taken on a test machine
               RLPROXY_CACHE_DIR=str(model_cache_dir().parent),  # SmolLM2, fetched once
               # this machine's wheels, as a user who has used pip before has: the install is
               # still resolved against the index and into the fresh venv, without downloading
               # mlx, transformers and the rest again on every run (minutes of the suite)
               PIP_CACHE_DIR=os.environ.get("PIP_CACHE_DIR") or str(
                   Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pip"))
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-c", serve_line], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, log, timeout_s=900)  # the install, then the first start
        assert (venv / "bin" / "rlproxy").exists()  # the venv's, not this test's
        words = shlex.split(blocks[1])
        endpoint = next(w for w in words if w.startswith("http"))
        body = json.loads(words[words.index("-d") + 1])
        r = requests.post(endpoint.replace("127.0.0.1:8000", f"127.0.0.1:{port}"), json=body,
                          timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].strip() == promised
        health = requests.get(url + "/healthz").json()
        assert health["model"] == "smollm2-135m-instruct"
        assert health["data_dir"] == str(home / ".rlproxy" / "smollm2-135m-instruct")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (home / ".rlproxy" / "smollm2-135m-instruct" / "rlproxy.lock").exists()
