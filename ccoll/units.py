"""Sizes, rates and times: parsing what people type and formatting what they read.

The one place for units; the ``ccoll`` command, ``ccoll bench``, the ``CCOLL_*``
environment overrides and ``jobs/emulated_cluster.py`` all use it. It imports nothing from
ccoll at load time, so a script can load this file alone (the launcher of the emulated
cluster must not start MPI by importing the package).

Case matters where it carries meaning: ``B`` is a byte, ``b`` a bit (``10GB/s`` is
80 Gbit/s, ``10Gb/s`` is 10 Gbit/s). Rates need a unit; a string that could be read two
ways (``10G``, tc's ``100mbps``, which tc reads as megabytes and most tools as megabits)
is refused with a message that says what to write. docs/cli.md lists the accepted forms.
"""

from __future__ import annotations

import math
import re
from typing import NoReturn

__all__ = [
    "parse_size",
    "parse_rate",
    "parse_time",
    "format_size",
    "format_iec",
    "format_bytes",
    "format_time",
]

_NUM = r"(?P<num>[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)"
# The prefix letter's case is free (no one means milli- or micro-bits); "i" makes it binary.
_SPLIT = re.compile(rf"^\s*{_NUM}\s*(?P<prefix>[kKmMgGtT]i?)?(?P<unit>[A-Za-z/]*)\s*$")
_POW = {"k": 1, "m": 2, "g": 3, "t": 4}

# Rate units, case-sensitive except the spelled-out words.
_BIT_UNITS = {"b", "b/s", "bps"}
_BYTE_UNITS = {"B", "B/s", "Bps"}
_BIT_WORDS = {"bit", "bits", "bit/s", "bits/s"}
_BYTE_WORDS = {"byte", "bytes", "byte/s", "bytes/s"}

_SIZE_HINT = "size must look like 4, 64K, 64M (binary: 64 MiB), 64MiB or 64MB (decimal)"
_RATE_HINT = "must look like 10Gbit or 1.25GB/s (b = bit, B = byte)"
_TIME_HINT = "time must look like 5us, 0.2ms or 1e-6 (seconds)"


def _fail(msg: str) -> NoReturn:
    # Imported here so that loading this file alone pulls in nothing else (module docstring).
    from ccoll.errors import UnitError

    raise UnitError(msg)


def _split(text: str) -> tuple[float, str, str] | None:
    m = _SPLIT.match(text)
    if m is None:
        return None
    return float(m.group("num")), m.group("prefix") or "", m.group("unit")


def parse_size(text: str | int) -> int:
    """Bytes from ``4``, ``64K``, ``64M``, ``1G``, ``64MiB`` or ``64MB``.

    A bare prefix is binary, as OSU and nccl-tests use it (``64M`` = 64 MiB); ``KiB`` ...
    ``TiB`` are binary, ``kB`` ... ``TB`` decimal (SI). A bit unit (``64Mb``) is refused:
    a message size is in bytes. Raises :class:`ccoll.errors.UnitError` (a ``ValueError``).
    """
    if isinstance(text, int):
        if text < 0:
            _fail(f"size must be >= 0, got {text}")
        return text
    parts = _split(str(text))
    if parts is None:
        _fail(f"{_SIZE_HINT}, got {text!r}")
    num, prefix, unit = parts
    if unit not in ("", "B") and unit.lower() not in _BYTE_WORDS - {"byte/s", "bytes/s"}:
        if unit in ("b", "bit", "bits"):
            _fail(f"a size is in bytes, not bits (B = byte, b = bit): got {text!r}; {_SIZE_HINT}")
        _fail(f"{_SIZE_HINT}, got {text!r}")
    if prefix and unit and prefix[0] == "m":
        _fail(f"'m' is milli; write M for mega (64MB, 64MiB or 64M), got {text!r}")
    if not prefix:
        scale = 1
    elif len(prefix) == 2 or not unit:
        scale = 1024 ** _POW[prefix[0].lower()]
    else:
        scale = 1000 ** _POW[prefix[0].lower()]
    v = num * scale
    if not math.isfinite(v) or v < 0 or v != int(v):
        _fail(f"size must be a whole, finite number of bytes >= 0, got {text!r}")
    return int(v)


def parse_rate(text: str | float, what: str = "bandwidth") -> float:
    """Bytes per second from a rate with its unit.

    ``10Gbit``, ``10Gb/s``, ``10Gbps`` and ``1.25GB/s``, ``1.25GBps`` are all 1.25e9 bytes/s;
    ``1GiB/s`` is 2**30. Prefixes are decimal (``k M G T``) unless binary (``Ki Mi Gi Ti``);
    ``b`` is a bit, ``B`` a byte; ``bit`` and ``byte`` may be spelled out in any case, and
    then the prefix too (tc's ``500mbit``). Refused, with what to write instead: no unit
    (``10G``: bits or bytes?), tc's ``100mbps`` (tc reads it as megabytes/s, most tools as
    megabits/s), a lowercase ``m``/``g``/``t`` before ``b`` or ``B``, unknown units, rates
    <= 0. A number (not a string) is bytes per second. ``what`` names the quantity in
    messages.
    """
    if isinstance(text, (int, float)):
        if not text > 0:
            _fail(f"{what} must be > 0, got {text!r}")
        return float(text)
    parts = _split(str(text))
    if parts is None:
        _fail(f"{what} {_RATE_HINT}, got {text!r}")
    num, prefix, unit = parts
    if unit in _BIT_UNITS or unit.lower() in _BIT_WORDS:
        bits_per_unit = 1
    elif unit in _BYTE_UNITS or unit.lower() in _BYTE_WORDS:
        bits_per_unit = 8
    elif not unit:
        _fail(f"{what} {text!r} has no unit: bits or bytes? It {_RATE_HINT}")
    else:
        _fail(f"{what} {text!r}: unknown unit {unit!r}; it {_RATE_HINT}")
    spelled = unit.lower() in _BIT_WORDS | _BYTE_WORDS
    if prefix and prefix[0].islower() and unit == "bps":
        upper = prefix[0].upper() + prefix[1:]
        _fail(
            f"{what} {text!r} is ambiguous: tc reads '{prefix}bps' as {upper}B/s, most tools "
            f"as {upper}bit/s; write {num:g}{upper}bit or {num:g}{upper}B/s"
        )
    if prefix and prefix[0] in "mgt" and not spelled:
        upper = prefix[0].upper() + prefix[1:]
        _fail(
            f"{what} {text!r}: write the prefix as {upper!r} ({num:g}{upper}{unit}); a lowercase "
            "prefix is taken only before a spelled-out bit or byte (500mbit)"
        )
    scale = 1
    if prefix:
        base = 1024 if len(prefix) == 2 else 1000
        scale = base ** _POW[prefix[0].lower()]
    v = num * scale * bits_per_unit / 8
    if not v > 0:
        _fail(f"{what} must be > 0, got {text!r}")
    return v


_TIME_RE = re.compile(rf"^\s*{_NUM}\s*(?P<unit>ns|us|µs|μs|ms|s)?\s*$")
_TIME_SCALE = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}


def parse_time(text: str | float) -> float:
    """Seconds from ``5us``, ``0.2ms``, ``1e-6`` (a bare number is seconds); >= 0."""
    if isinstance(text, (int, float)):
        v = float(text)
    else:
        m = _TIME_RE.match(str(text))
        if m is None:
            _fail(f"{_TIME_HINT}, got {text!r}")
        v = float(m.group("num")) * _TIME_SCALE[m.group("unit")]
    if not v >= 0:
        _fail(f"time must be >= 0, got {text!r}")
    return v


def format_size(n: float) -> str:
    """``67108864`` -> ``64M`` (binary multiples, as :func:`parse_size` reads them back)."""
    for unit, p in (("T", 4), ("G", 3), ("M", 2), ("K", 1)):
        div = 1024**p
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return f"{n:.0f}"


def format_iec(n: float) -> str:
    """``67108864`` -> ``64 MiB`` (for messages meant to be read)."""
    f = format_size(n)
    return f"{f[:-1]} {f[-1]}iB" if f[-1] in "KMGT" else f"{f} B"


def format_bytes(n: float | None) -> str:
    """``17490000`` -> ``17.49 MB`` (decimal, for the HDF5 reports); ``-`` for ``None``."""
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0
    return str(n)  # pragma: no cover


def format_time(s: float) -> str:
    """``5e-5`` -> ``50.0 us``, ``0.0123`` -> ``12.30 ms``, ``2`` -> ``2.000 s``."""
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"
