"""Every option with a default says which in ``--help``: ccoll's commands, the demo, the
warm-up, the emulated-cluster launcher and the examples."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ccoll import cli, demo, warmup
from ccoll.helpformat import shows_default

REPO = Path(__file__).resolve().parent.parent


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ccoll_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    top = cli.build_parser()
    out = [("ccoll", top)]
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += [(f"ccoll {name}", p) for name, p in action.choices.items()]
    return out


def _example_parser() -> argparse.ArgumentParser:
    pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "examples"))
    try:
        return _load(REPO / "examples" / "train_ddp.py", "train_ddp_example").build_parser()
    finally:
        sys.path.remove(str(REPO / "examples"))


PARSERS = {
    **dict(_ccoll_parsers()),
    "python -m ccoll.demo": demo.build_parser(),
    "python -m ccoll.warmup": warmup.build_parser(),
    "jobs/emulated_cluster.py": _load(REPO / "jobs" / "emulated_cluster.py",
                                      "emulated_cluster_help").build_parser(),
}


def _missing(parser: argparse.ArgumentParser) -> list[str]:
    fmt = parser._get_formatter()
    return [
        "/".join(a.option_strings) or a.dest
        for a in parser._actions
        if shows_default(a) and "default" not in (fmt._get_help_string(a) or "").lower()
    ]


def test_every_ccoll_subcommand_is_checked() -> None:
    names = set(PARSERS)
    for sub in ("compress", "decompress", "inspect", "eval", "bench", "model"):
        assert f"ccoll {sub}" in names


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_shows_every_default(name: str) -> None:
    parser = PARSERS[name]
    assert _missing(parser) == []
    parser.format_help()  # renders (a stray % in a help string would raise here)


def test_example_help_shows_every_default_and_names_make_minilm() -> None:
    parser = _example_parser()
    assert _missing(parser) == []
    text = parser.format_help()
    assert "make minilm" in text
    assert "(default: 300)" in text  # --steps


def test_appended_default_is_rendered() -> None:
    text = PARSERS["ccoll eval"].format_help()
    assert "best kept (default: 3)" in " ".join(text.split())


_MARKUP = re.compile(r"``|:(?:func|mod|class|meth|attr|data|exc):`")


@pytest.mark.parametrize("name", sorted(n for n in PARSERS if n.startswith("ccoll")))
def test_help_is_plain_text(name: str) -> None:
    # --help is read in a terminal: no reST roles or double backquotes from docstrings.
    text = PARSERS[name].format_help()
    assert _MARKUP.findall(text) == [], text


def test_bench_help_explains_every_column_and_the_data() -> None:
    from ccoll import bench

    text = " ".join(PARSERS["ccoll bench"].format_help().split())
    for column in bench.COLUMNS:
        assert re.search(rf"(^| ){re.escape(column)} ", text), column
    assert "spread evenly over the whole step" in text  # how each size's data is chosen


def test_docs_explain_every_bench_column() -> None:
    from ccoll import bench

    doc = (REPO / "docs" / "cli.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|", doc.split("## ccoll bench: columns", 1)[1],
                      flags=re.MULTILINE)
    assert rows[: len(bench.COLUMNS)] == list(bench.COLUMNS)
