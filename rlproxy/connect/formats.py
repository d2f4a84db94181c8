"""Read and write an agent's config text as an editable document, keeping what connect does not
touch: tomlkit and ruamel.yaml keep comments, key order and layout; JSON keeps key order and the
file's indent (JSON has no comments: a file with any is refused rather than stripped of them).

Knows nothing of agents or of what goes into their files (agents.py)."""

from __future__ import annotations

import io
import json
import re

import tomlkit
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap


class ConfigError(ValueError):
    """The existing file cannot be merged into without losing something; says what to do."""


KEY_LINE = re.compile(r"( *)[^\s#-][^#]*:(\s|$)")  # `key:` or `key: value`, at its indent
DASH_LINE = re.compile(r"( *)- +\S")


def yaml_indent(text: str) -> dict:
    """ruamel's indent(mapping, sequence, offset) as TEXT already has it, so lines connect does
    not touch keep their bytes: the first nested key's indent, and where the first list's dashes
    stand under their key (PyYAML's default: at the key's column; others: indented). A new file,
    or one without nesting or lists: 2-space mappings, dashes indented by 2."""
    mapping, offset, sequence = 2, 2, 4
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    nested = next((m for m in map(KEY_LINE.match, lines) if m and m.group(1)), None)
    if nested:
        mapping = len(nested.group(1))
        offset, sequence = mapping, mapping + 2
    for above, line in zip(lines, lines[1:]):
        dash, key = DASH_LINE.match(line), KEY_LINE.match(above)
        if dash and key and not above.lstrip().startswith("-"):
            offset = len(dash.group(1)) - len(key.group(1))
            sequence = offset + len(dash.group(0)) - 1 - len(dash.group(1))
            break
    return {"mapping": mapping, "sequence": sequence, "offset": offset}


def _yaml(text: str = "") -> YAML:
    y = YAML()  # round-trip: comments, order and quoting survive a load and dump
    y.preserve_quotes = True
    y.width = 4096  # never re-wrap the user's long strings
    y.indent(**yaml_indent(text))
    return y


def load(fmt: str, text: str, path: str = "the file"):
    """The document in `text` (empty text: an empty document)."""
    try:
        if fmt == "toml":
            return tomlkit.parse(text)
        if fmt == "yaml":
            doc = _yaml().load(text) if text.strip() else None
            if doc is None:
                return CommentedMap()
            if not isinstance(doc, dict):
                raise ConfigError(f"{path} holds a YAML {type(doc).__name__}, not a mapping")
            return doc
        doc = json.loads(text) if text.strip() else {}
    except ConfigError:
        raise
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not plain JSON ({e}): rlproxy connect does not rewrite "
                          "files with comments or trailing commas (it would lose them); edit "
                          "it by hand (see docs/agents.md) or remove them") from None
    except Exception as e:  # tomlkit's and ruamel's parse errors share no base class
        raise ConfigError(f"{path} does not parse as {fmt.upper()}: {e}") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} holds a JSON {type(doc).__name__}, not an object")
    return doc


def dump(fmt: str, doc, original: str = "") -> str:
    """The document as text; JSON in the original's indent (2 spaces for a new file)."""
    if fmt == "toml":
        return tomlkit.dumps(doc)
    if fmt == "yaml":
        out = io.StringIO()
        _yaml(original).dump(doc, out)
        return out.getvalue()
    indent = re.search(r"^\{\s*\n([ \t]+)\S", original)
    return json.dumps(doc, indent=indent.group(1) if indent else 2, ensure_ascii=False) + "\n"


def table(doc, key: str, fmt: str, header: bool = False):
    """doc[key] as a mapping, created empty (in the format's own mapping type) when absent.
    TOML: `header` gives the new table its own [header]; else it only holds sub-tables."""
    if key not in doc or doc[key] is None:
        doc[key] = (tomlkit.table(is_super_table=not header) if fmt == "toml"
                    else CommentedMap() if fmt == "yaml" else {})
    value = doc[key]
    if not isinstance(value, dict):
        raise ConfigError(f"`{key}` is a {type(value).__name__} in the existing file, not a "
                          "table of settings: fix or remove it first")
    return value
