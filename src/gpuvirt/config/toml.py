"""Values as TOML shows them: type words for messages, basic strings, shortened values."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import date, datetime, time


def toml_type(value: object) -> str:
    """The TOML word for a value's type, for 'got a string'-style messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str | os.PathLike):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, datetime | date | time):
        return "a date/time"
    if value is None:
        return "nothing"
    return type(value).__name__


def toml_str(text: str) -> str:
    """A TOML basic string (json.dumps would emit surrogate pairs TOML refuses)."""
    out = ['"']
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def show(value: object) -> str:
    """A value as it would look in TOML, shortened."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = toml_str(value)
    elif isinstance(value, int | float):
        text = repr(value)
    elif isinstance(value, list | tuple):
        text = "[" + ", ".join(show(v) for v in value) + "]"
    elif isinstance(value, Mapping):
        text = "{" + ", ".join(f"{k} = {show(v)}" for k, v in value.items()) + "}"
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
