"""ccoll.torch without MPI peers: import isolation, hook-state validation, process group."""

from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from kit import assert_clear_error  # noqa: E402

import ccoll  # noqa: E402
from ccoll.errors import ErrorBoundError, InputError  # noqa: E402


def test_import_ccoll_does_not_import_torch() -> None:
    code = "import sys, ccoll; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_state_defaults() -> None:
    from mpi4py import MPI

    from ccoll.torch import CCollHookState

    s = CCollHookState()
    try:
        assert s.eb == ccoll.REL(1e-3)
        assert (s.error_feedback, s.start_iter, s.iter, s.residuals) == (False, 0, 0, {})
        assert MPI.Comm.Compare(s.comm, MPI.COMM_WORLD) == MPI.CONGRUENT  # a duplicate
        assert not hasattr(s, "__dict__")
        assert "REL(0.001)" in repr(s)
        assert s.policy == s.communicator.policy == "auto"
    finally:
        s.close()


@pytest.mark.parametrize("eb", [ccoll.ABS(1e-5), ccoll.REL(1e-2), "abs:1e-4", "rel:1e-3"])
def test_state_accepts_bounds(eb) -> None:
    from ccoll.torch import CCollHookState

    s = CCollHookState(eb=eb)
    assert s.eb == ccoll.errorbound.as_bound(eb)
    s.close()


@pytest.mark.parametrize(
    ("kw", "exc", "match"),
    [
        ({"eb": "rel:-1"}, ErrorBoundError, "finite and > 0"),
        ({"eb": "zz:1"}, ErrorBoundError, "kind must be 'rel' or 'abs'"),
        ({"eb": [1e-3]}, ErrorBoundError, "expected ccoll.ABS"),
        ({"error_feedback": 1}, InputError, "error_feedback must be True or False"),
        ({"start_iter": -1}, InputError, "start_iter must be an int >= 0"),
        ({"start_iter": 1.0}, InputError, "start_iter must be an int >= 0"),
        ({"min_numel": True}, InputError, "min_numel must be an int >= 0"),
        ({"comm": "world"}, InputError, "comm must be an mpi4py intracommunicator"),
        ({"policy": "sometimes"}, InputError, "policy must be one of 'compress', 'auto'"),
    ],
    ids=lambda v: repr(v)[:30],
)
def test_state_rejects(kw, exc, match) -> None:
    from ccoll.torch import CCollHookState

    assert_clear_error(exc, match, CCollHookState, **kw)


def test_hook_rejects_foreign_state() -> None:
    from ccoll.torch import comm_hook

    assert_clear_error(
        InputError, "state must be a ccoll.torch.CCollHookState", comm_hook, {}, None
    )


def test_process_group_single_rank_is_idempotent() -> None:
    import torch.distributed as dist

    from ccoll.torch import init_process_group_from_mpi

    assert not dist.is_initialized()
    try:
        assert init_process_group_from_mpi() == (0, 1)
        assert init_process_group_from_mpi() == (0, 1)
        t = torch.arange(3.0)
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0]
    finally:
        dist.destroy_process_group()


def test_process_group_rejects_unknown_backend() -> None:
    from ccoll.torch import init_process_group_from_mpi

    with pytest.raises(ValueError, match="backend must be one of"):
        init_process_group_from_mpi("carrier-pigeon")


@pytest.mark.parametrize("policy, loaded", [("auto", True), ("raw", False)])
def test_state_loads_the_kernels_before_training(policy, loaded) -> None:
    # The compressor's kernels load when the state is made (before training), so that the
    # first compressed step does not pay for numba's set-up; a raw state compresses nothing
    # and loads nothing. In a fresh process: this one has loaded them long ago.
    code = (
        "import ccoll.torch as ct\n"
        "from ccoll.compressor.cpu import decode, encode\n"
        "assert not encode._range_kernel.signatures and not decode._decode.signatures\n"
        f"s = ct.CCollHookState(policy={policy!r})\n"
        "print(bool(encode._range_kernel.signatures), bool(encode._plan_lossy.signatures),\n"
        "      bool(decode._decode.signatures))\n"
        "s.close()\n"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600, check=False)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == [str(loaded)] * 3
