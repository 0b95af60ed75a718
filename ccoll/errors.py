"""Exceptions raised by ccoll.

Every exception derives from :class:`CCollError` and also from the built-in that
fits the problem, so callers can catch either.
"""

from __future__ import annotations

import argparse

__all__ = [
    "CCollError",
    "FormatError",
    "ErrorBoundError",
    "MismatchError",
    "CollectiveError",
    "CCollTimeoutError",
    "InputError",
    "UnitError",
    "DTypeError",
]


class CCollError(Exception):
    """Base class of every error that ccoll raises on purpose."""


class FormatError(CCollError, ValueError):
    """A compressed stream is malformed, truncated, foreign or of an unknown version."""


class ErrorBoundError(CCollError, ValueError):
    """An error bound is invalid (not finite, not positive) or cannot be met."""


class MismatchError(CCollError, ValueError):
    """Ranks of one collective disagree on count, dtype, bound or operation."""


class CollectiveError(CCollError, RuntimeError):
    """A collective failed on some rank; every rank of the communicator raises it."""


class CCollTimeoutError(CCollError, TimeoutError):
    """Waiting for an asynchronous operation (a request, an event) ran past its timeout."""


class InputError(CCollError, ValueError):
    """An input file or argument cannot be used (not HDF5, a pattern matching nothing, ...)."""


class UnitError(InputError, argparse.ArgumentTypeError):
    """A size, rate or time that cannot be read (``ccoll.units``).

    Also an ``argparse.ArgumentTypeError``, so a command-line option parsed by ``ccoll.units``
    shows this message (argparse replaces a plain ``ValueError``'s by "invalid value").
    """


class DTypeError(CCollError, TypeError):
    """Data of a dtype ccoll cannot take; the message names the fix.

    ccoll takes float32 and float64 anywhere, float16 and bfloat16 on the host.
    """
