"""Scheduling of ccoll's work: the asynchronous progress engine and the GPU/CPU lanes.

``progress`` runs asynchronous collectives on one background thread (``submit`` ->
``Request``). The lane scheduler shares a device between training, compression, reduction
and copies; see docs/scheduler.md.
"""

from ccoll.gpu_sched.progress import ProgressEngine, Request, engine, shutdown, submit

__all__ = ["ProgressEngine", "Request", "engine", "shutdown", "submit"]
