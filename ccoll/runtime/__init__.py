"""What runs ccoll's work, independent of the device: the progress engine and CPU threads.

:mod:`ccoll.runtime.progress` runs asynchronous collectives on one background thread
(``submit`` -> ``Request``); the collectives and the PyTorch DDP hook build on it.
:mod:`ccoll.runtime.cpu_threads` prepares the process for numba's parallel CPU kernels
(the OpenMP wait policy, a thread-safe threading layer) right before the first launch.
See docs/scheduler.md.
"""
