"""Command-line flags made from the settings fields, so that a setting's default, choices and
help live in one place (rlproxy/settings.py). Each field becomes `--field-name`; a bool field
a `--x/--no-x` pair; a list field a repeatable flag; a Literal field a flag with choices.
Flags not given parse to None, so they leave the environment's and the file's values alone.

Owns the field -> flag mapping and the README's flag table. Does not own the settings or
their merge (rlproxy/settings.py), nor the subcommands (rlproxy/cli.py).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from types import UnionType
from typing import Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from rlproxy.settings import SECTIONS, field_section


# Spellings beside --field-name, shown first (the README and scripts use the singular).
ALIASES = {"reward_functions": "--reward-function",
           "eval_reward_functions": "--eval-reward-function"}
METAVARS = {int: "N", float: "NUM", str: "TEXT", Path: "PATH"}


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def flag_names(field: str) -> list[str]:
    return [ALIASES[field], flag_name(field)] if field in ALIASES else [flag_name(field)]


def shown(value) -> str:
    """A default as the help shows it: on/off, a list comma-separated, ~ for the home dir."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    if isinstance(value, Path) and value.is_relative_to(Path.home()):
        return str(Path("~") / value.relative_to(Path.home()))
    return str(value)


def help_text(info: FieldInfo) -> str:
    """The field's description plus its default, unless the description explains its default
    itself (a None default always does: what unset means is not in the value)."""
    text = info.description or ""
    if "default:" not in text:
        text += f" (default: {shown(info.default)})"
    return text.replace("%", "%%")  # argparse %-formats help strings


def flag_kwargs(info: FieldInfo) -> dict:
    """argparse arguments for one settings field, read off its type: bool -> --x/--no-x,
    list -> repeatable, Literal -> choices (of the literals' own type: Literal[4, 8] -> int)."""
    kind = info.annotation
    if get_origin(kind) in (Union, UnionType):  # X | None: the flag gives an X
        kind = next(a for a in get_args(kind) if a is not type(None))
    # default None: a flag not given leaves the environment's, the file's or the field's value
    kwargs: dict = {"default": None, "help": help_text(info)}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif get_origin(kind) is list:
        kwargs.update(action="append", type=get_args(kind)[0])
    elif get_origin(kind) is Literal:
        choices = get_args(kind)
        kwargs.update(choices=choices, type=type(choices[0]))
    else:
        kwargs["type"] = kind  # str, int, float, Path
    if "choices" not in kwargs and kind is not bool:
        kwargs["metavar"] = METAVARS.get(kwargs["type"], "VALUE")
    return kwargs


def add_setting_flag(p: argparse.ArgumentParser, name: str, **overrides) -> None:
    info = SECTIONS[field_section(name)].model_fields[name]
    p.add_argument(*flag_names(name), dest=name, **{**flag_kwargs(info), **overrides})


SETTINGS_SOURCES = (
    "Each setting is also a key of its section in the --config TOML file and an "
    "RLPROXY_<FIELD> environment variable (lists comma-separated). Flags win over the "
    "environment, the environment over the file, the file over the defaults.")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """--config, one flag per settings field (grouped by section), --log-level."""
    p.add_argument("--config", metavar="FILE", help="TOML file with sections "
                   + " ".join(f"[{section}]" for section in SECTIONS)
                   + " (see deploy/rlproxy.example.toml)")
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(f"[{section}] settings")
        for name in cls.model_fields:
            add_setting_flag(group, name)
    p.add_argument("--log-level", default="INFO", metavar="LEVEL",
                   help="DEBUG, INFO, WARNING or ERROR (default: INFO)")


def flags_table() -> str:
    """The README's table of `rlproxy serve` flags, from the same fields (regenerate it with
    `python3 -c 'from rlproxy.flags import flags_table; print(flags_table())'`)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for section, cls in SECTIONS.items():
        rows.append(f"| **[{section}]** | | |")
        for name, info in cls.model_fields.items():
            flags = " / ".join(f"`{f}`" for f in flag_names(name))
            if info.annotation is bool:
                flags = f"`{flag_name(name)}` / `--no-{flag_name(name)[2:]}`"
            meaning, default = info.description, f"`{shown(info.default)}`"
            if said := re.search(r"default: ([^);]*)", meaning):  # it explains its default
                default = said[1]
                meaning = re.sub(r"\s*\(default: [^)]*\)|;\s*default: [^);]*", "", meaning)
            if "choices" in (kwargs := flag_kwargs(info)) and not all(
                    str(c) in meaning for c in kwargs["choices"]):
                meaning += " (" + ", ".join(f"`{c}`" for c in kwargs["choices"]) + ")"
            rows.append(f"| {flags} | {default} | {meaning.replace('|', '/')} |")
    return "\n".join(rows)


def flags_from(args: argparse.Namespace) -> dict:
    """The flags that are settings (a subcommand's own arguments, like --from, are not)."""
    fields = {name for cls in SECTIONS.values() for name in cls.model_fields}
    return {k: v for k, v in vars(args).items() if k in fields}
