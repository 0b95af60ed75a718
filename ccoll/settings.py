"""ccoll's settings: every ``CCOLL_*`` variable, read once into one frozen object.

A :class:`~ccoll.collectives.communicator.Communicator` reads them when it is made
(:func:`current`: the environment, with what :func:`configure` set on top) and keeps that
:class:`Settings` for its life: no call reads the environment again, so a variable changed
later applies to Communicators made later. The settings that decide which collectives a
rank makes (the calibration's) are checked across ranks when a Communicator is made
(:attr:`Settings.digest` is part of its agreement). docs/collectives.md, "Settings", has
the table; :data:`TABLE` is its source.

Process-wide settings (the kernels' thread count, the scheduler's lanes, the log level, the
progress engine's exit timeout) take effect from the first Communicator made, or from the
first kernel or request that needs them when there is none.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Settings", "TABLE", "DEFAULT_TIMEOUT", "current", "configure", "parse"]

#: Seconds a collective may wait without progress (nothing arrives, nothing completes)
#: before it raises ``CollectiveError`` on every rank that waits: the default of
#: ``Communicator(timeout=)``, set with ``CCOLL_TIMEOUT`` (``none`` waits forever, as MPI).
#: A deadline on progress, not on the call: a large call that keeps moving is never cut.
#: Ten minutes, as PyTorch's default for NCCL's collectives.
DEFAULT_TIMEOUT = 600.0


@dataclass(frozen=True, slots=True)
class Settings:
    """The settings of one Communicator (defaults: nothing set). See :data:`TABLE`."""

    log: str = "off"
    threads: int | None = None
    sched: bool = True
    node_shm: bool = True
    cuda_aware: bool | None = None
    calibration: str = "cache"
    cache_dir: str | None = None
    alpha: float | None = None
    bandwidth: float | None = None
    compress_gbps: float | None = None
    add_gbps: float | None = None
    decompress_gbps: float | None = None
    reduce_gbps: float | None = None
    overhead: float | None = None
    ratio: float | None = None
    efficiency: float | None = None
    shutdown_timeout: float = 30.0
    timeout: float | None = DEFAULT_TIMEOUT

    @property
    def digest(self) -> int:
        """A 52-bit fingerprint of the settings that change which collectives run.

        Exact in float64 (it travels in the agreement). Settings that may differ by rank
        without changing any collective are left out: the log level, the progress engine's
        exit timeout, the threads, the lanes, the node's shared memory (the node agrees on
        it when it sets it up), device staging and the cache's folder (rank 0's is used).
        """
        vals = [(f.name, getattr(self, f.name)) for f in fields(self)
                if f.name not in _LOCAL]
        raw = repr(vals).encode()
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 12

    def overrides(self, agreed: bool = False) -> str:
        """Return the settings that differ from the defaults, as ``name=value`` pairs.

        ``agreed``: only those the ranks must agree on (the ones :attr:`digest` covers),
        as a mismatch message shows them.
        """
        base = Settings()
        out = [f"{f.name}={_shown(getattr(self, f.name))}" for f in fields(self)
               if getattr(self, f.name) != getattr(base, f.name)
               and not (agreed and f.name in _LOCAL)]
        return " ".join(out) if out else "none set"


def _shown(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else repr(v)


_LOCAL = frozenset({"log", "shutdown_timeout", "threads", "sched", "node_shm", "cuda_aware",
                    "cache_dir"})


def _switch(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("", "1", "on", "true", "yes"):
        return True
    if v in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{name}={raw!r} is not a switch: set it to 'off' or 'on' (or unset it)")


def _positive(name: str, raw: str, parse_fn: Any = float) -> float:
    try:
        v = float(parse_fn(raw))
    except ValueError as e:
        raise ValueError(f"{name}={raw!r}: {e}") from None
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name}={raw!r} must be a finite number > 0")
    return v


# The most GB/s a rate setting takes: 1e9 GB/s is far above any device, and the model's
# bytes per second (x 1e9) of a rate near float64's largest overflowed to inf, a traceback
# of the Communicator's construction on every rank.
_MAX_GBPS = 1e9


def _gbps(name: str, raw: str) -> float:
    v = _positive(name, raw)
    if v > _MAX_GBPS:
        raise ValueError(f"{name}={raw!r} must be at most {_MAX_GBPS:g} GB/s")
    return v


def _time(raw: str) -> float:
    from ccoll.units import parse_time

    return parse_time(raw)


def _rate(raw: str) -> float:
    from ccoll.units import parse_rate

    return parse_rate(raw)


def _log(name: str, raw: str) -> str:
    v = raw.strip().lower()
    if v in ("", "off", "0", "none"):
        return "off"
    if v in ("debug", "info", "warning"):
        return v
    raise ValueError(f"{name}={raw!r} is not a log level: set it to info, debug, warning or "
                     "off (or unset it)")


def _threads(name: str, raw: str) -> int | None:
    v = raw.strip()
    if not v:
        return None
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"{name}={raw!r} is not a thread count: set it to a whole number >= 1 (threads "
            "per rank for ccoll's CPU kernels), or unset it to use the rank's share of its "
            "node's cores")
    return n


def _calibration(name: str, raw: str) -> str:
    v = raw.strip().lower()
    if v in ("", "cache", "on"):
        return "cache"
    if v in ("refresh", "off"):
        return v
    raise ValueError(f"{name}={raw!r}: set it to refresh (probe again and rewrite the cache), "
                     "off (neither read nor write the cache) or unset it")


def _cuda_aware(name: str, raw: str) -> bool | None:
    v = raw.strip()
    if v == "":
        return None
    if v in ("0", "1"):
        return v == "1"
    raise ValueError(f"{name}={raw!r}: set it to 1 (MPI takes device pointers), 0 (stage "
                     "through host memory) or unset it (ask MPI)")


def _seconds_or_none(name: str, raw: str) -> float | None:
    v = raw.strip().lower()
    if v == "":
        return DEFAULT_TIMEOUT
    if v in ("none", "off", "0", "inf", "never"):
        return None
    return _positive(name, raw, _time)


# (field, variable, default shown, meaning, parser(name, raw) -> value): the docs' table.
TABLE: tuple[tuple[str, str, str, str, Any], ...] = (
    ("log", "CCOLL_LOG", "off", "one log line per call on stderr: info, debug, warning or off",
     _log),
    ("threads", "CCOLL_THREADS", "the rank's share of its node's cores",
     "threads of ccoll's CPU kernels per rank", _threads),
    ("sched", "CCOLL_SCHED", "on", "run compute on the process-wide lanes of the scheduler "
     "(off: a private thread per channel)", _switch),
    ("node_shm", "CCOLL_NODE_SHM", "on", "the node phases of two-level collectives in shared "
     "memory (off: MPI inside the node)", _switch),
    ("cuda_aware", "CCOLL_CUDA_AWARE", "asked of MPI", "1: MPI takes device pointers; 0: "
     "stage device buffers through pinned host memory", _cuda_aware),
    ("calibration", "CCOLL_CALIBRATION", "cache", "refresh: probe again and rewrite the "
     "calibration cache; off: neither read nor write it", _calibration),
    ("cache_dir", "CCOLL_CACHE_DIR", "$XDG_CACHE_HOME/ccoll or ~/.cache/ccoll",
     "folder of the calibration cache", lambda n, r: r or None),
    ("alpha", "CCOLL_ALPHA", "probed", "link latency per ring step (e.g. 5us)",
     lambda n, r: _positive(n, r, _time)),
    ("bandwidth", "CCOLL_BANDWIDTH", "probed", "link bandwidth per direction (e.g. 10Gbit)",
     lambda n, r: _positive(n, r, _rate)),
    ("compress_gbps", "CCOLL_COMPRESS_GBPS", "measured", "compressor rate, GB/s of input",
     _gbps),
    ("add_gbps", "CCOLL_ADD_GBPS", "measured", "homomorphic add rate, GB/s", _gbps),
    ("decompress_gbps", "CCOLL_DECOMPRESS_GBPS", "measured", "decompressor rate, GB/s",
     _gbps),
    ("reduce_gbps", "CCOLL_REDUCE_GBPS", "measured", "plain float sum rate, GB/s", _gbps),
    ("overhead", "CCOLL_OVERHEAD", "measured", "fixed cost of one compressed call (e.g. "
     "150us)", lambda n, r: _positive(n, r, _time)),
    ("ratio", "CCOLL_RATIO", "sampled per call signature", "compression ratio the model "
     "assumes", _positive),
    ("efficiency", "CCOLL_EFFICIENCY", "1", "share of the compressor rates reached inside a "
     "collective", _positive),
    ("shutdown_timeout", "CCOLL_SHUTDOWN_TIMEOUT", "30s", "how long the progress engine "
     "waits for requests at exit", lambda n, r: _positive(n, r, _time)),
    ("timeout", "CCOLL_TIMEOUT", "600s", "default Communicator(timeout=): seconds a "
     "collective may wait without progress (nothing from its peers) before it raises "
     "CollectiveError on every rank that waits; none (or off, never, inf, 0): wait "
     "forever, as MPI",
     _seconds_or_none),
)

_lock = threading.Lock()
_configured: dict[str, Any] = {}


def parse(environ: Mapping[str, str] | None = None) -> tuple[Settings, list[str]]:
    """Read the ``CCOLL_*`` variables of ``environ`` (default ``os.environ``) once.

    Returns the settings and the problems found (one message per bad variable, naming it
    and the fix; that variable keeps its default). :func:`configure`'s values win.
    """
    env = os.environ if environ is None else environ
    kw: dict[str, Any] = {}
    problems: list[str] = []
    for name, var, _, _, fn in TABLE:
        raw = env.get(var)
        if raw is None or not raw.strip():  # empty (VAR= in a job script): not set, for all
            continue
        try:
            kw[name] = fn(var, raw)
        except ValueError as e:
            problems.append(str(e))
    with _lock:
        kw.update(_configured)
    return Settings(**kw), problems


def current() -> Settings:
    """Return the settings a Communicator made now gets (a bad value keeps its default)."""
    return parse()[0]


_BOOLS = frozenset({"sched", "node_shm", "cuda_aware"})
_TEXTS = frozenset({"log", "calibration", "cache_dir"})


def _value(name: str, v: Any) -> Any:
    """Return a :func:`configure` value as the setting holds it; InputError if it is bad.

    A string is read as the ``CCOLL_*`` variable would be (``bandwidth="10Gbit"``,
    ``timeout="90s"``); otherwise a switch takes a bool, ``threads`` a whole number >= 1,
    and the rest a finite number > 0 in the setting's unit (seconds, bytes per second,
    GB/s).
    """
    from ccoll.errors import InputError

    var, parser = next((var, fn) for f, var, _, _, fn in TABLE if f == name)
    if isinstance(v, str):
        try:
            return parser(var, v)
        except ValueError as e:
            raise InputError(f"configure({name}={v!r}): {e}") from None
    if name in _BOOLS:
        if isinstance(v, bool):
            return v
    elif name == "threads":
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v
    elif name not in _TEXTS:
        if name == "timeout" and isinstance(v, float) and v == math.inf:
            return None  # wait forever, as CCOLL_TIMEOUT=inf and Communicator(timeout=inf)
        if (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and v > 0):
            if name.endswith("_gbps") and v > _MAX_GBPS:
                raise InputError(f"configure({name}={v!r}): at most {_MAX_GBPS:g} GB/s")
            return float(v)
    raise InputError(f"configure({name}={v!r}): expected "
                     + ("True or False" if name in _BOOLS
                        else "a whole number >= 1" if name == "threads"
                        else "a string" if name in _TEXTS
                        else "a finite number > 0 or a string as its variable takes, "
                             f"e.g. {var}'s"))


def configure(**values: Any) -> Settings:
    """Set settings for Communicators made from now on, over the environment's.

    Keyword names are :class:`Settings` fields (``threads=4``, ``calibration="off"``,
    ``timeout=60``, ...); ``None`` removes an earlier :func:`configure` value. Returns the
    settings a Communicator made now would get. Call it with the same values on every
    rank: the Communicator checks that ranks agree.
    """
    names = {f.name for f in fields(Settings)}
    bad = sorted(set(values) - names)
    if bad:
        raise TypeError(f"unknown ccoll setting(s) {', '.join(bad)}; known: "
                        f"{', '.join(sorted(names))}")
    # Every value is checked before any is set. A value may read as None (timeout="none":
    # wait forever), which is then the setting, unlike a None passed here (removed).
    parsed = {k: _value(k, v) for k, v in values.items() if v is not None}
    with _lock:
        for k, v in values.items():
            if v is None:
                _configured.pop(k, None)
        _configured.update(parsed)
    return current()
