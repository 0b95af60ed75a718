"""The DDP hook's CUDA path waits for the training stream on the device, not on the host.

No GPU here: ``torch.cuda.current_stream`` is replaced by a recorder, and the bucket is a
CPU tensor, which then goes through the hook's host path (one rank).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ccoll.torch as ct  # noqa: E402
from ccoll.torch import hook  # noqa: E402


class _Ready:
    """A stand-in for the torch.cuda.Event the hook records on the training stream."""

    host_waits = 0

    def synchronize(self) -> None:
        _Ready.host_waits += 1


class _Stream:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def wait_event(self, ev: Any) -> None:
        self.log.append(ev)


def test_hook_waits_for_the_training_stream_on_the_device(monkeypatch):
    log: list[Any] = []
    devices: list[Any] = []

    def current_stream(device: Any = None) -> _Stream:
        devices.append(device)
        return _Stream(log)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    state = ct.CCollHookState(policy="compress")
    try:
        t = torch.arange(8, dtype=torch.float32)
        ready = _Ready()
        out = hook._average_timed(state, t, 0, False, ready)
    finally:
        state.close()
    assert out is t and torch.equal(t, torch.arange(8, dtype=torch.float32))  # one rank
    # The engine thread's stream waits for the training stream's event: the host never
    # blocks on training (ccoll's lanes then wait for this stream in the collective).
    assert log == [ready] and devices == [t.device]
    assert _Ready.host_waits == 0
