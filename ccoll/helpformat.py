"""The ``--help`` formatter of ccoll's commands: every option with a default shows it.

Options whose help already says its default (``"(default 64M)"``, ``"default: all"``) keep
their words; the others get ``(default: X)`` appended. Options without a meaningful default
(``None``, flags that are off) get nothing. Descriptions keep their line breaks.
"""

from __future__ import annotations

import argparse

__all__ = ["DefaultsFormatter", "shows_default"]


def shows_default(action: argparse.Action) -> bool:
    """Tell whether ``action`` has a default worth printing."""
    if action.default in (None, False, argparse.SUPPRESS, [], ()) or isinstance(
        action, (argparse._HelpAction, argparse._VersionAction)
    ):
        return False
    return bool(action.option_strings) or action.nargs in ("?", "*")


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter):
    """Raw descriptions, and ``(default: X)`` after every option help that lacks it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if text == argparse.SUPPRESS or not shows_default(action) or "default" in text.lower():
            return action.help
        return f"{text} (default: %(default)s)".lstrip()
