"""Fault behaviour of the collectives, each in its own 4-rank ``mpiexec`` job.

A rank that raises in the middle of a collective must end the whole job (``python -m
mpi4py`` aborts on an uncaught exception), and with ``Communicator(timeout=...)`` ranks
stuck behind a stalled peer raise ``CollectiveError`` instead of waiting forever.

No check reads the clock for an upper limit: a stalled peer here never resumes, so a rank
that did not give up would wait until the job's own limit (``run_job``), which fails the
test. What the ranks print says which deadline ended the wait (its timeout in seconds),
and the time they waited is checked from below only: a timeout never fires early.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MPIEXEC = Path(sys.executable).parent / "mpiexec"

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="needs the mpiexec of the venv")

PRELUDE = """
import os, sys, time
import numpy as np
from mpi4py import MPI
import ccoll
from ccoll.collectives import homomorphic
from ccoll.errors import CollectiveError

comm = MPI.COMM_WORLD
x = np.linspace(-1, 1, 200_000, dtype=np.float32) * (comm.rank + 1)

# Each rank's lines also go to a file of its own: mpiexec forwards stdout asynchronously,
# and the MPI_Abort that ends most of these jobs can drop lines not forwarded yet.
_builtin_print = print
_log = open(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                         f"rank{comm.rank}.out"), "a", buffering=1)


def print(*args, **kw):
    kw.pop("file", None)
    _builtin_print(*args, **kw)
    _builtin_print(*args, file=_log, flush=True)
"""


def run_job(tmp_path: Path, body: str, limit: float = 240) -> subprocess.CompletedProcess:
    """Run ``body`` on 4 ranks; a job still running after ``limit`` s fails the test."""
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    proc = subprocess.run(
        [str(MPIEXEC), "-n", "4", sys.executable, "-m", "mpi4py", str(script)],
        capture_output=True, text=True, timeout=limit, env=env,
    )
    # What the ranks printed, from their own files (complete even where MPI_Abort cut
    # mpiexec's forwarding short), rank by rank.
    logs = sorted(tmp_path.glob("rank*.out"))
    if logs:
        proc.stdout = "".join(p.read_text() for p in logs)
    return proc


def test_exception_mid_collective_ends_the_job(tmp_path):
    proc = run_job(tmp_path, """
        if comm.rank == 2:
            calls = [0]
            real = homomorphic.HomomorphicOps.combine

            def failing(self, *args):
                calls[0] += 1
                if calls[0] == 3:  # a few chunks into the ring
                    raise RuntimeError("injected failure on rank 2")
                return real(self, *args)

            homomorphic.HomomorphicOps.combine = failing
        with ccoll.Communicator(comm, chunk_elems=4096, policy="compress") as c:
            c.allreduce(x, eb=ccoll.REL(1e-3))
        print(f"rank {comm.rank} finished", flush=True)
    """)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "injected failure on rank 2" in proc.stderr
    assert proc.stdout.count("finished") < 4


def test_timeout_turns_a_stalled_peer_into_collective_error(tmp_path):
    proc = run_job(tmp_path, """
        import threading
        c = ccoll.Communicator(comm, chunk_elems=4096, timeout=3.0, policy="compress")
        c.allreduce(x[:1000], eb=ccoll.REL(1e-3))  # warm-up: compile before timing
        if comm.rank == 2:
            real = homomorphic.HomomorphicOps.combine

            def stalled(self, *args):
                threading.Event().wait()  # a peer that stops making progress mid-ring, for good
                return real(self, *args)

            homomorphic.HomomorphicOps.combine = stalled
        t0 = time.monotonic()
        try:
            c.allreduce(x, eb=ccoll.REL(1e-3))
            print(f"rank {comm.rank} finished", flush=True)
        except CollectiveError as exc:
            print(f"rank {comm.rank} CollectiveError after {time.monotonic() - t0:.1f} s: {exc}",
                  flush=True)
        try:
            c.allreduce(x, eb=ccoll.REL(1e-3))
        except CollectiveError as exc:
            print(f"rank {comm.rank} refuses: {exc}", flush=True)
        comm.Barrier()
        if comm.rank == 0:
            comm.Abort(7)  # what an application does after a failed collective
        time.sleep(60)
    """)
    out = proc.stdout
    assert out.count("CollectiveError after") == 4, out + proc.stderr
    assert out.count("refuses: this ccoll Communicator cannot be used") == 4, out
    for line in out.splitlines():
        if "CollectiveError after" in line:
            assert "timeout of 3.0 s" in line, line
            assert float(line.split("after ")[1].split(" s")[0]) >= 2.9, line
    assert proc.returncode != 0


def test_the_default_timeout_is_ten_minutes_and_none_waits_forever():
    # PyTorch's default for NCCL's collectives, the reference: ten minutes. An
    # empty variable is unset; "none" (and the other spellings) waits forever, as MPI.
    from ccoll.settings import parse

    assert parse({})[0].timeout == 600.0
    assert parse({"CCOLL_TIMEOUT": ""})[0].timeout == 600.0
    for forever in ("none", "off", "0", "inf", "never", " None "):
        settings, problems = parse({"CCOLL_TIMEOUT": forever})
        assert (settings.timeout, problems) == (None, []), forever
    assert parse({"CCOLL_TIMEOUT": "90"})[0].timeout == 90.0
    settings, problems = parse({"CCOLL_TIMEOUT": "-5"})
    assert settings.timeout == 600.0 and len(problems) == 1 and "CCOLL_TIMEOUT" in problems[0]


SKIPPED_CALLS = ["first call", "repeated exact call", "repeated auto call", "compressed call",
                 "iallreduce", "module function"]


def test_a_rank_that_skips_a_call_fails_the_others_by_default(tmp_path):
    # No Communicator here gets a timeout and CCOLL_TIMEOUT is unset: the default, ten
    # minutes (PyTorch's for NCCL), ends every wait. The deadlines' clock
    # (ccoll.collectives.waiting._clock) runs SPEED times faster than the real one, so that
    # ten minutes pass in three seconds. Rank 3 skips one call of each kind; ranks 0-2 must
    # raise CollectiveError after the timeout, in the agreement, in a repeated call's MPI
    # collective (the fast way: no agreement), in the engine's request, ...
    proc = run_job(tmp_path, """
        os.environ.pop("CCOLL_TIMEOUT", None)
        from ccoll.collectives import waiting
        SPEED = 200.0
        _t0 = time.monotonic()
        waiting._clock = lambda: _t0 + (time.monotonic() - _t0) * SPEED
        timeout = ccoll.Communicator(comm).timeout
        print(f"rank {comm.rank}: default timeout {timeout}", flush=True)
        SKIPPER = 3
        small = x[:1000].copy()

        def repeated(c, fast=True, **kw):
            for _ in range(4):
                c.allreduce(small, **kw)
            if c.last_call.overlapped != fast:
                print(f"rank {comm.rank}: NOT the expected way: {c.last_call}", flush=True)
            return c

        def module_function():
            w = comm.Dup()
            ccoll.allreduce(small, eb=None, comm=w)
            ccoll.allreduce(small, eb=None, comm=w)
            return w

        setups = {
            "first call": lambda: ccoll.Communicator(comm),
            "repeated exact call": lambda: repeated(ccoll.Communicator(comm), eb=None),
            "repeated auto call": lambda: repeated(ccoll.Communicator(comm),
                                                   eb=ccoll.REL(1e-3)),
            "compressed call": lambda: repeated(ccoll.Communicator(comm, policy="compress"),
                                                fast=False, eb=ccoll.REL(1e-3)),
            "iallreduce": lambda: ccoll.Communicator(comm),
            "module function": module_function,
        }
        calls = {
            "first call": lambda c: c.allreduce(x, eb=None),
            "repeated exact call": lambda c: c.allreduce(small, eb=None),
            "repeated auto call": lambda c: c.allreduce(small, eb=ccoll.REL(1e-3)),
            "compressed call": lambda c: c.allreduce(small, eb=ccoll.REL(1e-3)),
            "iallreduce": lambda c: c.iallreduce(x, eb=None).wait(),
            "module function": lambda w: ccoll.allreduce(small, eb=None, comm=w),
        }
        for name, setup in setups.items():
            state = setup()
            comm.Barrier()
            if comm.rank != SKIPPER:
                t0 = waiting._clock()
                try:
                    calls[name](state)
                    print(f"rank {comm.rank} {name}: finished", flush=True)
                except CollectiveError as exc:
                    print(f"rank {comm.rank} {name}: CollectiveError after "
                          f"{waiting._clock() - t0:.1f} s: {exc}", flush=True)
            comm.Barrier()
        print(f"rank {comm.rank} done", flush=True)
        comm.Barrier()
        if comm.rank == 0:
            comm.Abort(7)  # calls left pending: what an application does after a failure
        time.sleep(60)
    """, limit=240)
    out = proc.stdout
    assert out.count("default timeout 600.0") == 4, out + proc.stderr
    assert out.count("done") == 4, out + proc.stderr
    assert "NOT the expected way" not in out and "finished" not in out, out
    for name in SKIPPED_CALLS:
        lines = [ln for ln in out.splitlines() if f" {name}: CollectiveError after" in ln]
        assert len(lines) == 3, (name, out)
        for line in lines:
            assert "timeout of 600.0 s" in line, line
            assert float(line.split("after ")[1].split(" s")[0]) >= 600, line


def test_failure_in_the_plan_stage_fails_the_channel_everywhere(tmp_path):
    # The plan is made after the agreement: a rank that raises there leaves its peers
    # waiting in the data collective, so it must mark its channel failed like a failure
    # while data moves.
    proc = run_job(tmp_path, """
        from ccoll.collectives.policy import plan

        real = plan.Planner.plan

        def failing(self, *args, **kw):
            if comm.rank == 0:
                raise RuntimeError("injected failure in the plan on rank 0")
            return real(self, *args, **kw)

        plan.Planner.plan = failing
        c = ccoll.Communicator(comm, chunk_elems=4096, timeout=4.0, policy="compress")
        t0 = time.monotonic()
        try:
            c.allreduce(x, eb=ccoll.REL(1e-3))
            print(f"rank {comm.rank} finished", flush=True)
        except CollectiveError as exc:  # a RuntimeError too: first
            print(f"rank {comm.rank} CollectiveError after {time.monotonic() - t0:.1f} s: "
                  f"{exc}", flush=True)
        except RuntimeError as exc:
            print(f"rank {comm.rank} RuntimeError: {exc}", flush=True)
        try:
            c.allreduce(x, eb=ccoll.REL(1e-3))
        except CollectiveError as exc:
            print(f"rank {comm.rank} refuses: {exc}", flush=True)
        comm.Barrier()
        if comm.rank == 0:
            comm.Abort(7)  # what an application does after a failed collective
        time.sleep(60)
    """)
    out = proc.stdout
    assert out.count("RuntimeError: injected failure in the plan on rank 0") == 1, (
        out + proc.stderr)
    assert out.count("CollectiveError after") == 3, out + proc.stderr
    for line in out.splitlines():
        if "CollectiveError after" in line:
            assert "timeout of 4.0 s" in line, line
            assert float(line.split("after ")[1].split(" s")[0]) >= 3.9, line
    refusals = [ln for ln in out.splitlines() if "refuses:" in ln]
    assert len(refusals) == 4, out
    for line in refusals:
        # refused at once: no second wait for the peers (that would end in the timeout's
        # message instead)
        assert "cannot be used after an earlier collective failed" in line, line
    assert proc.returncode != 0


def test_two_threads_create_defaults_for_two_communicators_in_opposite_orders(tmp_path):
    # Creating a default Communicator is collective over its communicator; the ranks
    # start the two creations in opposite orders, so a process-wide lock held across the
    # creation would deadlock them.
    proc = run_job(tmp_path, """
        import threading
        from ccoll.collectives import communicator
        from ccoll.collectives.registry import default_communicator

        c1, c2 = comm.Dup(), comm.Dup()
        first, second = (c1, c2) if comm.rank % 2 == 0 else (c2, c1)
        made = {}

        # The creation's first collective (MPI_Comm_dup of its communicator) cannot finish
        # before the other ranks' second thread joins it: once the first thread is there,
        # whatever it holds it holds until the second thread has gone through.
        entered = threading.Event()
        real_dup = communicator.dup_comm

        def dup_comm(*args):
            entered.set()
            return real_dup(*args)

        communicator.dup_comm = dup_comm

        def make(c, name):
            made[name] = default_communicator(c)

        t1 = threading.Thread(target=make, args=(first, "first"), daemon=True)
        t1.start()
        assert entered.wait(60)  # the first creation has started its collective
        t2 = threading.Thread(target=make, args=(second, "second"), daemon=True)
        t2.start()
        t1.join(30)
        t2.join(30)
        if t1.is_alive() or t2.is_alive():
            print(f"rank {comm.rank} deadlocked", flush=True)
            os._exit(3)
        assert default_communicator(first) is made["first"]
        y = ccoll.allreduce(x[:10], eb=None, comm=c1)
        z = ccoll.allreduce(x[:10], eb=None, comm=c2)
        assert y.tobytes() == z.tobytes()
        c1.Free()
        c2.Free()
        print(f"rank {comm.rank} finished", flush=True)
    """, limit=120)
    assert proc.stdout.count("finished") == 4, proc.stdout + proc.stderr
    assert proc.returncode == 0


@pytest.mark.parametrize("stage", ["Communicator", "iallreduce"])
def test_duplicating_the_communicator_honours_the_timeout(tmp_path, stage):
    # Rank 3 never joins the collective MPI_Comm_dup (of the Communicator, or of its
    # iallreduce channel): the others must give up after their timeout.
    proc = run_job(tmp_path, f"""
        stage = {stage!r}
        w = comm.Dup()  # the stalled collective stays off COMM_WORLD (Barrier below)
        c = None
        if stage == "iallreduce":
            c = ccoll.Communicator(w, timeout=2.0, policy="raw")
        t0 = time.monotonic()
        if comm.rank != 3:
            try:
                if stage == "Communicator":
                    ccoll.Communicator(w, timeout=2.0)
                else:
                    c.iallreduce(x, eb=None).wait(timeout=30)
                print(f"rank {{comm.rank}} finished", flush=True)
            except CollectiveError as exc:
                print(f"rank {{comm.rank}} CollectiveError after "
                      f"{{time.monotonic() - t0:.1f}} s: {{exc}}", flush=True)
        comm.Barrier()
        if comm.rank == 0:
            comm.Abort(7)
        time.sleep(60)
    """, limit=90)
    assert_three_timed_out(proc, "duplicating the communicator")


def test_agreement_error_report_honours_the_timeout(tmp_path):
    # Ranks 0-2 disagree with rank 3 and go on to exchange their error reports; rank 3
    # stops right after the agreement (as if it died there): the others must give up
    # after the timeout instead of waiting in the exchange forever.
    proc = run_job(tmp_path, """
        from ccoll.collectives import agreement
        from ccoll.errors import MismatchError

        from ccoll.collectives import communicator
        from ccoll.collectives.policy.calibration import DEFAULT

        w = comm.Dup()  # the abandoned exchange stays off COMM_WORLD (Barrier below)
        if comm.rank == 3:
            agreement._raise = lambda *args: None
            # and it takes part in nothing after the agreement (the threads' exchange, the
            # node grouping)
            communicator.node_threads = lambda *args: (1, "stand-in")
            from ccoll.collectives.node import grouping_of
            communicator.node_comms = lambda c, r, d: (grouping_of(c.Get_size(), c.Get_rank(),
                                                                   1), None, None)
            communicator._calibration.obtain = lambda *args, **kw: DEFAULT
        t0 = time.monotonic()
        try:
            c = ccoll.Communicator(w, chunk_elems=1000 + (comm.rank == 3), timeout=2.0)
            print(f"rank {comm.rank} made it", flush=True)
        except CollectiveError as exc:
            print(f"rank {comm.rank} CollectiveError after "
                  f"{time.monotonic() - t0:.1f} s: {exc}", flush=True)
        except MismatchError as exc:
            print(f"rank {comm.rank} MismatchError: {exc}", flush=True)
        comm.Barrier()
        if comm.rank == 0:
            comm.Abort(7)
        time.sleep(60)
    """, limit=90)
    assert_three_timed_out(proc, "error report")


def assert_three_timed_out(proc, where):
    """Ranks 0-2 raised CollectiveError in ``where`` after the 2 s timeout, not before."""
    out = proc.stdout
    assert out.count("CollectiveError after") == 3, out + proc.stderr
    for line in out.splitlines():
        if "CollectiveError after" in line:
            assert where in line and "timeout of 2.0 s" in line, line
            assert float(line.split("after ")[1].split(" s")[0]) >= 1.9, line


def test_calls_after_mpi_finalize_raise_instead_of_ending_the_process(tmp_path):
    # MPICH ended the process ("Attempting to use an MPI routine ... after finalizing",
    # exit status 1) at a ccoll call after the user's MPI.Finalize(): the calls of a
    # Communicator, the module's collectives, a new Communicator, a first iallreduce and
    # even the local last_call().
    proc = run_job(tmp_path, """
        c = ccoll.Communicator(comm)
        y = c.allreduce(x[:1000], eb=ccoll.REL(1e-3))
        ccoll.allreduce(x[:1000], eb=None)
        me = comm.rank  # comm.rank is an MPI call too
        MPI.Finalize()
        for name, call in [
            ("blocking", lambda: c.allreduce(x[:1000], eb=ccoll.REL(1e-3))),
            ("exact", lambda: c.allreduce(x[:1000], eb=None)),
            ("first iallreduce", lambda: c.iallreduce(x[:1000]).wait()),
            ("module", lambda: ccoll.allreduce(x[:1000])),
            ("new", lambda: ccoll.Communicator(comm)),
        ]:
            try:
                call()
                print(f"rank {me} {name}: no error", flush=True)
            except CollectiveError as exc:
                assert "MPI is already finalized" in str(exc), exc
                print(f"rank {me} {name}: CollectiveError", flush=True)
        rep = ccoll.last_call()
        print(f"rank {me} last_call: {rep.compressed}", flush=True)
        c.close()
        print(f"rank {me} done", flush=True)
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("blocking", "exact", "first iallreduce", "module", "new"):
        assert proc.stdout.count(f"{name}: CollectiveError") == 4, proc.stdout
    assert proc.stdout.count("last_call: False") == 4 and proc.stdout.count("done") == 4
