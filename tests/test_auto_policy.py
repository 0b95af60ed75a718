"""``policy="auto"`` without MPI: known_raw and decide read the same calibrations alike.

The policy runs on a stub channel of 4 ranks with calibrations set by hand (the numbers
every rank would have agreed on), so only the local arithmetic is exercised.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from ccoll.collectives import model
from ccoll.collectives.policy.auto import DECISION_MARGIN, AutoPolicy
from ccoll.collectives.policy.fits import CompressorCalibration, size_class
from ccoll.collectives.policy.probes import LinkCalibration

N = 4
COUNT = 4 << 20  # float32 elements per rank: 16 MiB
LINK = LinkCalibration(alpha=5e-6, beta=1.25e9, reduce=8e9, source="env", raw_efficiency=1.0)
COMP = CompressorCalibration(compress=1e9, add=1e9, decompress=1e9, chunk_overhead=1e-5,
                             source="measured", call_overhead=2e-4)


class _Comm:
    def Get_size(self) -> int:
        return N

    def Get_rank(self) -> int:
        return 0


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    for k in ("CCOLL_ALPHA", "CCOLL_BANDWIDTH", "CCOLL_OVERHEAD", "CCOLL_RATIO",
              "CCOLL_EFFICIENCY", "CCOLL_CALIBRATION"):
        monkeypatch.delenv(k, raising=False)


def _policy(raw_eff_at_size: float | None) -> AutoPolicy:
    """A policy whose link, compressor and (optionally) MPI efficiency are calibrated."""
    ch = SimpleNamespace(comm=_Comm(), timeout=None, name="stub", failed=None)
    pol = AutoPolicy(ch)  # type: ignore[arg-type]
    pol._link = LINK
    pol._comp[f"cpu/float32/{size_class(COUNT)}"] = COMP
    if raw_eff_at_size is not None:
        pol._raw_eff[(4, COUNT.bit_length())] = raw_eff_at_size
    return pol


def _pays_at_any_ratio(raw_efficiency: float) -> bool:
    """What decide's "compressor slower than the link" test says, computed from the model."""
    pol = _policy(None)
    p = replace(pol.params(COMP), raw_efficiency=raw_efficiency)
    pred = model.predict(float(COUNT * 4), N, p, 1e30, chunks=1)
    return pred.homomorphic * (1 + DECISION_MARGIN) < pred.raw


def test_the_numbers_make_the_raw_efficiency_decide():
    # MPI reaching the whole link: compressing cannot pay; a fifth of it: it can.
    assert not _pays_at_any_ratio(1.0)
    assert _pays_at_any_ratio(0.2)


def test_known_raw_uses_the_raw_efficiency_that_decide_uses():
    # decide() measured MPI at this size reaching a fifth of the link, so it compresses
    # (and calibrated the compressor doing so). known_raw must not now settle the size
    # as raw from the probe's efficiency (1.0): that would send it raw for good.
    pol = _policy(0.2)
    assert pol.call_params(COUNT, 4, "allreduce", COMP).raw_efficiency == 0.2
    assert pol.known_raw(COUNT, np.dtype(np.float32)) is False
    assert pol.known_raw(COUNT, np.dtype(np.float32)) is False  # and it stays so


def test_known_raw_settles_raw_where_decide_would():
    pol = _policy(1.0)
    assert pol.known_raw(COUNT, np.dtype(np.float32)) is True


def test_known_raw_waits_for_the_raw_efficiency_at_this_size():
    # Only decide() measures MPI at a new size (collectively); until then nothing is known.
    pol = _policy(None)
    assert pol.call_params(COUNT, 4, "allreduce", COMP) is None
    assert pol.known_raw(COUNT, np.dtype(np.float32)) is False


def test_bcast_uses_the_probe_efficiency_in_both():
    # decide() models bcast with the probe's efficiency; so does known_raw.
    pol = _policy(0.2)
    assert pol.call_params(COUNT, 4, "bcast", COMP).raw_efficiency == LINK.raw_efficiency
