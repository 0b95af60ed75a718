"""Progress bars for long file operations (tqdm on stderr; stdout stays for results)."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

__all__ = ["bar"]


def bar(total: int, *, enabled: bool, desc: str, unit: str = "dataset") -> Any:
    """Make a tqdm bar on stderr, or a disabled one (same interface) when ``enabled`` is false."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=not enabled,
        leave=False,
        dynamic_ncols=True,
    )
