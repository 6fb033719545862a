"""Sizes ("2GiB", "1.5 GiB", 4096) and windows ("3/60s"): parsing with reasons, exact printing."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from gpuvirt.config.toml import toml_type
from gpuvirt.defaults import GiB, KiB, MiB, TiB

# A size string longer than this is garbage, and refusing it early keeps huge
# digit strings away from Fraction().
_MAX_SIZE_TEXT = 64
MAX_SIZE = (1 << 64) - 1


_SIZE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)[ \t]*([A-Za-z]*)", re.ASCII)
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": KiB,
    "ki": KiB,
    "kib": KiB,
    "kb": 1000,
    "m": MiB,
    "mi": MiB,
    "mib": MiB,
    "mb": 1000**2,
    "g": GiB,
    "gi": GiB,
    "gib": GiB,
    "gb": 1000**3,
    "t": TiB,
    "ti": TiB,
    "tib": TiB,
    "tb": 1000**4,
}
_UNIT_HELP = (
    "use B, KiB, MiB, GiB, TiB (K, M, G, T mean the same) or KB, MB, GB, TB for powers of 1000"
)


def parse_size(value: int | str, *, allow_zero: bool = False) -> int:
    """Bytes in a size such as ``"2GiB"``, ``"1.5 GiB"``, ``"1GB"``, ``"4096"`` or ``4096``.

    KiB/MiB/GiB/TiB and bare K/M/G/T are powers of 1024; KB/MB/GB/TB are
    powers of 1000. Units are case-insensitive and may follow a space. The
    result must be a whole number of bytes. Raises ValueError with the reason.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(
            f'expected a size (a whole number of bytes or a string like "2GiB"), '
            f"got {toml_type(value)}"
        )
    if isinstance(value, int):
        n = value
    else:
        text = value.strip()
        if len(text) > _MAX_SIZE_TEXT:
            raise ValueError("not a size: far too long")
        if text.startswith("-"):
            raise ValueError("a size cannot be negative")
        m = _SIZE_RE.fullmatch(text)
        if m is None:
            raise ValueError(
                "not a size: expected a number with an optional unit, "
                "e.g. 2GiB, 256MiB, 1.5GiB or 4096"
            )
        number, unit = m.groups()
        multiplier = _SIZE_UNITS.get(unit.lower())
        if multiplier is None:
            raise ValueError(f"unknown size unit {unit!r}: {_UNIT_HELP}")
        exact = Fraction(number) * multiplier
        if exact.denominator != 1:
            raise ValueError(f"{number} {unit or 'B'} is not a whole number of bytes")
        n = int(exact)
    if n < 0:
        raise ValueError("a size cannot be negative")
    if n == 0 and not allow_zero:
        raise ValueError("a size must be greater than zero")
    if n > MAX_SIZE:
        raise ValueError("a size must be below 16 EiB")
    return n


_FORMAT_UNITS = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def format_size(n: int) -> str:
    """A byte count for people: ``"256 MiB"``, ``"1.5 GiB"``, ``"1500 B"``.

    Always exact: the largest binary unit is used only when the number fits
    in at most three decimals, so ``parse_size(format_size(n)) == n``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"format_size needs a non-negative int, got {n!r}")
    for unit, multiplier in _FORMAT_UNITS:
        if n >= multiplier:
            thousandths = Fraction(n * 1000, multiplier)
            if thousandths.denominator == 1:
                whole, frac = divmod(int(thousandths), 1000)
                number = str(whole) if frac == 0 else f"{whole}.{frac:03d}".rstrip("0")
                return f"{number} {unit}"
    return f"{n} B"


_WINDOW_RE = re.compile(r"([0-9]+)[ \t]*/[ \t]*([0-9]+(?:\.[0-9]+)?)[ \t]*([A-Za-z]+)", re.ASCII)
_WINDOW_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_window(value: str) -> tuple[int, float]:
    """``"3/60s"`` → ``(3, 60.0)``: a count per sliding window (units ms, s, m, h)."""
    if not isinstance(value, str):
        raise ValueError(f'expected a string like "3/60s", got {toml_type(value)}')
    m = _WINDOW_RE.fullmatch(value.strip())
    if m is None:
        raise ValueError(
            'expected COUNT/WINDOW such as "3/60s", "3/2m" or "5/500ms" (units ms, s, m, h)'
        )
    count_text, window_text, unit = m.groups()
    scale = _WINDOW_UNITS.get(unit.lower())
    if scale is None:
        raise ValueError(f"unknown time unit {unit!r}: use ms, s, m or h")
    count = int(count_text)
    window = float(window_text) * scale
    if count < 1:
        raise ValueError("the count must be at least 1")
    if not window > 0 or not math.isfinite(window):
        raise ValueError("the window must be longer than zero")
    return count, window
