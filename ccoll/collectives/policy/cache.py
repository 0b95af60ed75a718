"""The calibration cache: ``links.json`` in :func:`cache_dir`, one entry per set of links.

An entry holds a communicator's link constants (and, once measured, its compressor's),
under a key made of every rank's host name and network namespace, the size, and the MPI
transport settings (:func:`link_key`). Rank 0 alone reads and writes the file; what it
read reaches the other ranks as a fixed vector of doubles (:func:`read_link`), so every
rank uses the same numbers. Entries older than a week are probed again; ``ccoll model
--cached`` starts from the newest entry (:func:`newest_cached_params`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import stat
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from ccoll.collectives import model
from ccoll.collectives.channel import Channel
from ccoll.collectives.model import Params
from ccoll.collectives.policy.probes import LinkCalibration, allgather, bcast

__all__ = [
    "CACHE_MAX_AGE_S",
    "cache_dir",
    "cache_file",
    "link_key",
    "read_entry",
    "write_link",
    "write_compressor",
    "newest_cached_params",
]

CACHE_MAX_AGE_S = 7 * 24 * 3600.0
_TRANSPORT_ENV = (
    "MPIR_CVAR_NOLOCAL", "MPIR_CVAR_CH4_NETMOD", "FI_PROVIDER", "FI_TCP_IFACE",
    "CCOLL_CLUSTER_RATE_BPS", "UCX_NET_DEVICES", "UCX_TLS",
)
_MAX_ENTRIES = 64
_MAX_BYTES = 1 << 22  # a cache file larger than this is not one ccoll wrote (64 entries)


def cache_dir(folder: str | None = None) -> Path:
    """Folder of the calibration cache: ``folder`` (``CCOLL_CACHE_DIR``), else the default."""
    if folder:
        return Path(folder)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ccoll"


def cache_file(folder: str | None) -> Path:
    """Return the calibration cache's file in :func:`cache_dir`."""
    return cache_dir(folder) / "links.json"


def _read_cache(folder: str | None = None) -> dict[str, Any]:
    """Return the entries; ``{}`` for a file that is missing or not one ccoll could write.

    Only rank 0 reads it, so nothing here may raise or block: a FIFO or device at the path
    (``open`` would wait for a writer), a huge file, JSON nested too deep for the parser
    (``RecursionError``) count as no cache, as a truncated one does.
    """
    try:
        with open(cache_file(folder), "rb", opener=_open_nonblocking) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_BYTES:
                return {}
            doc = json.loads(f.read())
    except (OSError, ValueError, RecursionError):
        return {}
    # Entries are objects; anything else in the file (edited, or another tool's) is not one.
    return {k: v for k, v in doc.items() if isinstance(v, dict)} if isinstance(doc, dict) else {}


def _open_nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))


def _num(v: Any) -> float:
    """Return a cache entry's number; ``TypeError`` for a bool (``"alpha": true`` is no 1 s)."""
    if isinstance(v, bool):
        raise TypeError(v)
    return float(v)


def _when(e: dict[str, Any]) -> float:
    """Return an entry's time for ordering; -inf where missing or not a finite number."""
    try:
        t = float(e.get("time", 0.0))
    except (TypeError, ValueError, OverflowError):  # None, "soon", a 400-digit integer
        return -math.inf
    return t if math.isfinite(t) else -math.inf


def _write_cache(key: str, entry: dict[str, Any], folder: str | None) -> None:
    """Atomically add one entry (rank 0 only); keeps the 64 newest entries."""
    path = cache_file(folder)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = _read_cache(folder)
        doc[key] = entry
        if len(doc) > _MAX_ENTRIES:
            keep = sorted(doc, key=lambda k: _when(doc[k]))[-_MAX_ENTRIES:]
            doc = {k: doc[k] for k in keep}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".links-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs a probe per run


def newest_cached_params(folder: str | None = None) -> Params | None:
    """Model parameters from the newest cache entry (``ccoll model`` starts from them)."""
    # The newest entry whose numbers make valid parameters (a damaged one is skipped, as
    # read_entry skips it: the model's own checks name what is wrong with it).
    for e in sorted(_read_cache(folder).values(), key=_when, reverse=True):
        try:
            kw = {k: _num(e[k]) for k in ("alpha", "beta", "reduce", "raw_efficiency")
                  if k in e}
            comp = e.get("compressor") or {}
            if not isinstance(comp, dict):
                continue
            kw.update({k: _num(comp[k]) for k in ("compress", "add", "decompress",
                                                  "chunk_overhead") if k in comp})
            if float(comp.get("call_overhead", 0.0)) > 0:
                kw["overhead"] = float(comp["call_overhead"])
            return replace(model.DEFAULTS, **kw)
        except (TypeError, ValueError, OverflowError):
            continue
    return None


def _netns_id() -> str:
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return "-"


def link_key(ch: Channel) -> str:
    """Cache key of a channel's links (collective: every rank contributes its host).

    Host names alone do not tell two emulated clusters on one machine apart, so the key
    also holds each rank's network-namespace inode (a new one for every emulated cluster).
    Each rank contributes the SHA-256 of its ``host/namespace``: a fixed-size buffer.
    """
    comm = ch.comm
    mine = hashlib.sha256(f"{socket.gethostname()}/{_netns_id()}".encode()).digest()
    hosts = allgather(ch, np.frombuffer(mine, dtype=np.uint8), "cache key")
    env = [f"{k}={os.environ.get(k, '')}" for k in _TRANSPORT_ENV]
    raw = json.dumps([comm.Get_size(), hosts.tobytes().hex(), env,
                      MPI.Get_library_version()[:60]])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


_LINK_FIELDS = ("alpha", "beta", "reduce", "raw_efficiency")
# The rates of format 2 ("...2"), its ratio over format 1's ("gain2") and the range pass's
# rate ("scan") are measured with format 1's; an entry without them is measured again.
_COMP_FIELDS = ("compress", "add", "decompress", "chunk_overhead", "call_overhead",
                "compress2", "add2", "decompress2", "gain2", "scan")
_COMP_NEEDED = tuple(f for f in _COMP_FIELDS if f != "call_overhead")
_COMP_RATES = ("compress", "add", "decompress", "compress2", "add2", "decompress2", "gain2",
               "scan")


def read_entry(ch: Channel, key: str, folder: str | None) -> dict[str, float] | None:
    """Return the cache entry of ``key`` on every rank, or ``None`` (collective).

    Rank 0 reads the file and broadcasts what it found as one vector: a flag, the link's
    constants and, where the entry has them, the compressor's (then a second flag). An
    entry older than :data:`CACHE_MAX_AGE_S`, or a damaged one, counts as none.
    """
    k = len(_LINK_FIELDS)
    vec = np.zeros(2 + k + len(_COMP_FIELDS))
    if ch.comm.Get_rank() == 0:
        e = _read_cache(folder).get(key)
        try:
            if e and time.time() - _when(e) < CACHE_MAX_AGE_S:
                vec[1:1 + k] = [_num(e["alpha"]), _num(e["beta"]), _num(e["reduce"]),
                                _num(e.get("raw_efficiency", 1.0))]
                vec[0] = 1.0
                comp = e.get("compressor")
                if isinstance(comp, dict) and all(f in comp for f in _COMP_NEEDED):
                    vec[2 + k:] = [_num(comp.get(f, 0.0)) for f in _COMP_FIELDS]
                    vec[1 + k] = 1.0
        except (KeyError, TypeError, ValueError, OverflowError):
            vec[:] = 0.0  # a damaged entry: probe again
    bcast(ch, vec, 0, "calibration cache")
    # Every link constant > 0 (a hand-edited beta of 0 or -5 made the model's checks
    # raise inside the Communicator), every rate > 0 and the overheads >= 0.
    if vec[0] != 1.0 or not np.all(np.isfinite(vec)) or np.any(vec[1:1 + k] <= 0):
        return None
    out = {f: float(v) for f, v in zip(_LINK_FIELDS, vec[1:1 + k], strict=True)}
    rates = [2 + k + _COMP_FIELDS.index(f) for f in _COMP_RATES]
    if vec[1 + k] == 1.0 and np.all(vec[rates] > 0) and np.all(vec[2 + k:] >= 0):
        out.update({f: float(v) for f, v in zip(_COMP_FIELDS, vec[2 + k:], strict=True)})
    return out


def write_link(ch: Channel, key: str, cal: LinkCalibration, folder: str | None) -> None:
    """Store a probe's link constants under ``key`` (rank 0 writes; local)."""
    if ch.comm.Get_rank() != 0:
        return
    _write_cache(key, {"alpha": cal.alpha, "beta": cal.beta, "reduce": cal.reduce,
                       "raw_efficiency": cal.raw_efficiency, "time": time.time(),
                       "size": ch.comm.Get_size()}, folder)


def write_compressor(ch: Channel, key: str, compressor: dict[str, float],
                     folder: str | None) -> None:
    """Add the compressor's numbers to ``key``'s cache entry (rank 0 writes; local)."""
    if ch.comm.Get_rank() != 0:
        return
    entry = _read_cache(folder).get(key)
    if entry is not None:
        _write_cache(key, {**entry, "compressor": compressor}, folder)
