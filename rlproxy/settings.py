"""All configuration in one typed object, built once in `main` and passed down explicitly.

Sources, lowest to highest priority: defaults, an optional TOML file (sections named like the
classes below: `[server]`, `[model]`, ...), `RLPROXY_<FIELD>` environment variables (flat: field
names are unique across sections, e.g. `RLPROXY_API_KEY`, `RLPROXY_PORT`), command-line flags.
Every check lives here, and each message says what to change.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerSettings(Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    max_request_mb: float = Field(32.0, gt=0)
    served_model_name: list[str] = []  # aliases; the first is the name /v1/models reports
    strict_model_names: bool = False  # off: agents send names of their own, all served


class ModelSettings(Section):
    model: str | None = None  # a path or hub id; None serves the embedded default
    embedded_size: str = "tiny"
    adapter: str | None = None  # an mlx-lm adapter directory to start from
    lora_rank: int = Field(8, ge=1)
    lora_scale: float = Field(20.0, gt=0)
    lora_layers: int = Field(-1, description="LoRA on the last N blocks; -1 means all")
    lora_keys: list[str] | None = None  # None: every linear layer of each block (mlx-lm's default)

    @field_validator("embedded_size")
    @classmethod
    def _known_size(cls, v: str) -> str:
        from rlproxy.embedded_model import SIZES

        if v not in SIZES:
            raise ValueError(f"embedded_size must be one of {sorted(SIZES)}, not {v!r}")
        return v


class EngineSettings(Section):
    max_batch: int = Field(16, ge=1, description="concurrent sequences decoded together")
    prefill_step_size: int = Field(2048, ge=16)
    default_max_tokens: int = Field(
        1024, ge=1, description="completion cap when a request names none (OpenAI: context)"
    )


class RecordSettings(Section):
    data_dir: Path = Path.home() / ".rlproxy"
    fsync: bool = True  # fsync every record line: an acknowledged turn survives power loss too


class SessionSettings(Section):
    session_idle_timeout_s: float = Field(
        1800.0, gt=0, description="close a session after this long without a request")


class Settings(Section):
    server: ServerSettings = ServerSettings()
    model: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    records: RecordSettings = RecordSettings()
    sessions: SessionSettings = SessionSettings()


SECTIONS = {name: field.annotation for name, field in Settings.model_fields.items()}


def field_section(name: str) -> str:
    """The section that owns a (flat) field name, e.g. 'api_key' -> 'server'."""
    for section, cls in SECTIONS.items():
        if name in cls.model_fields:
            return section
    raise KeyError(name)


def _env_values(environ: dict[str, str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for section, cls in SECTIONS.items():
        for name, field in cls.model_fields.items():
            raw = environ.get(f"RLPROXY_{name.upper()}")
            if raw is None:
                continue
            value: Any = raw
            if "list" in str(field.annotation):
                value = [part.strip() for part in raw.split(",") if part.strip()]
            out.setdefault(section, {})[name] = value
    return out


def load_settings(
    flags: dict[str, Any] | None = None,
    config_file: str | Path | None = None,
    environ: dict[str, str] | None = None,
) -> Settings:
    """Merge the sources into one validated Settings; raise ValueError saying what to fix."""
    merged: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    if config_file:
        path = Path(config_file)
        try:
            toml = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist; fix --config") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {path} is not valid TOML: {e}") from None
        for section, values in toml.items():
            if section not in SECTIONS or not isinstance(values, dict):
                raise ValueError(
                    f"config file {path}: unknown section [{section}]; "
                    f"sections are {', '.join(SECTIONS)}"
                )
            merged[section].update(values)
    env = os.environ if environ is None else environ
    for section, values in _env_values(dict(env)).items():
        merged[section].update(values)
    for name, value in (flags or {}).items():
        if value is not None:
            merged[field_section(name)][name] = value
    try:
        return Settings(**merged)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise ValueError(f"invalid settings: {problems}") from None
