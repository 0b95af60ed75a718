"""Device lanes that share one device between training, compression, reduction and copies.

``Scheduler`` owns prioritized lanes (CUDA streams, or worker threads on the CPU); see
docs/scheduler.md.

The progress engine that runs asynchronous collectives lives in :mod:`ccoll.runtime.progress`;
its names are re-exported here for code written against earlier releases.
"""

from ccoll.gpu_sched.lanes import LANES, Event, Lane, current_lane, current_stream
from ccoll.gpu_sched.scheduler import (
    DEFAULT_PRIORITY_RANKS,
    Scheduler,
    configure,
    default_scheduler,
)
from ccoll.runtime.progress import ProgressEngine, Request, engine, shutdown, submit

__all__ = [
    "DEFAULT_PRIORITY_RANKS",
    "LANES",
    "Event",
    "Lane",
    "ProgressEngine",
    "Request",
    "Scheduler",
    "configure",
    "current_lane",
    "current_stream",
    "default_scheduler",
    "engine",
    "shutdown",
    "submit",
]
