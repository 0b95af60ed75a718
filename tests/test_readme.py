"""What README.md tells a user to call exists where it says.

Every dotted ``ccoll.…`` name in a code span or block of README.md resolves: a module that
imports, or an attribute of one (``ccoll.compressor.header``, not a ``ccoll.header`` that
the public API of ``ccoll/__init__.py`` does not have).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _names() -> list[str]:
    text = README.read_text()
    spans = re.findall(r"```.*?```|`[^`\n]+`", text, flags=re.DOTALL)
    return sorted({n for s in spans for n in re.findall(r"\bccoll(?:\.[A-Za-z_]\w*)+", s)})


def _resolve(name: str) -> Any:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: ModuleType | Any = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and not name.startswith(exc.name):
                raise  # a dependency is missing, not the name
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise AssertionError(name)


def test_readme_names_some_ccoll_functions() -> None:
    assert {"ccoll.compress", "ccoll.decompress", "ccoll.compressor.header"} <= set(_names())


@pytest.mark.parametrize("name", _names())
def test_every_ccoll_name_in_the_readme_exists(name: str) -> None:
    if name.startswith("ccoll.torch"):
        pytest.importorskip("torch")
    try:
        _resolve(name)
    except AttributeError as exc:
        pytest.fail(f"README.md names {name}, which does not exist: {exc}")
