"""Text a tenant controls, made safe to show an operator (DESIGN.md, "Untrusted inputs").

A guest publishes any `driver_version` it likes (it holds its VF2PF key), and
its kernels write what they like to their engine's stderr. Shown raw, such a
string would drive the operator's terminal (ESC sequences: a title, a
cleared screen, OSC 8 links, OSC 52 clipboard writes) or, through rich, its
markup (`[link=...]`). `printable` writes every character that is not plain
text as a Python escape (`\\x1b`, `\\u202e`), so what reaches a terminal, a
JSON consumer or a metrics label is the string's letters and nothing that
acts. The host applies it where tenant text enters (VF2PF, events); the CLI
applies it again to everything it prints, and prints values as rich Text,
never as markup. Backslashes stay as they are, so that applying it twice (host,
then CLI) changes nothing more: a tenant may spell `\\x1b` in letters, and those
letters are all it gets.
"""

from __future__ import annotations

import unicodedata
from typing import Any

# C0 and C1 controls, DEL; format characters (bidi overrides that reorder what is
# shown, zero-width joiners); line and paragraph separators; surrogates; unassigned
# and private-use code points a terminal may treat as anything.
_UNSAFE = frozenset(("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"))


def printable(text: object) -> str:
    """str(text) with every unsafe character written as an escape (idempotent)."""
    s = str(text)
    if s.isprintable():
        return s  # the common case, at C speed; isprintable() is false for every _UNSAFE
    return "".join(_escape(c) for c in s)


def printable_data(value: Any) -> Any:
    """`value` (JSON-like) with every string in it, keys too, made `printable`."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(k): printable_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_data(v) for v in value]
    return value


_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    if unicodedata.category(c) not in _UNSAFE:
        return c
    if c in _SHORT:
        return _SHORT[c]
    code = ord(c)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
