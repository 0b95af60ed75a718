"""Scheduling of ccoll's work: the asynchronous progress engine and the device lanes.

``progress`` runs asynchronous collectives on one background thread (``submit`` ->
``Request``). ``Scheduler`` shares a device between training, compression, reduction and
copies through prioritized lanes (CUDA streams, or worker threads on the CPU); see
docs/scheduler.md.
"""

from ccoll.gpu_sched.progress import ProgressEngine, Request, engine, shutdown, submit
from ccoll.gpu_sched.scheduler import (
    LANES,
    Event,
    Lane,
    Scheduler,
    current_lane,
    current_stream,
    default_scheduler,
)

__all__ = [
    "LANES",
    "Event",
    "Lane",
    "ProgressEngine",
    "Request",
    "Scheduler",
    "current_lane",
    "current_stream",
    "default_scheduler",
    "engine",
    "shutdown",
    "submit",
]
