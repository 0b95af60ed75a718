"""ccoll.settings: the CCOLL_* variables and configure() give the same settings, or errors."""

from __future__ import annotations

import math

import pytest

from ccoll.errors import InputError
from ccoll.settings import Settings, configure, parse


@pytest.fixture(autouse=True)
def _clean():
    names = [f for f in Settings.__dataclass_fields__]
    configure(**dict.fromkeys(names))
    yield
    configure(**dict.fromkeys(names))


@pytest.mark.parametrize("name, var, text, want", [
    ("bandwidth", "CCOLL_BANDWIDTH", "100Mbit", 12.5e6),
    ("bandwidth", "CCOLL_BANDWIDTH", "1.25GB/s", 1.25e9),
    ("alpha", "CCOLL_ALPHA", "5us", 5e-6),
    ("threads", "CCOLL_THREADS", "3", 3),
    ("sched", "CCOLL_SCHED", "off", False),
    ("log", "CCOLL_LOG", "info", "info"),
])
def test_a_string_reads_as_its_variable_does(name, var, text, want):
    env, problems = parse({var: text})
    assert problems == [] and getattr(env, name) == pytest.approx(want)
    got = configure(**{name: text})
    assert getattr(got, name) == pytest.approx(want)
    assert type(getattr(got, name)) is type(getattr(env, name))


def test_numbers_and_switches_as_values():
    got = configure(bandwidth=1.25e9, alpha=5e-6, threads=2, sched=False, timeout=90)
    assert (got.bandwidth, got.alpha, got.threads, got.sched, got.timeout) == (
        1.25e9, 5e-6, 2, False, 90.0)
    assert configure(bandwidth=None).bandwidth is None  # None removes a value


@pytest.mark.parametrize("kw, match", [
    ({"bandwidth": "fast"}, "CCOLL_BANDWIDTH='fast'"),  # once crashed the Communicator
    ({"bandwidth": -1.0}, "bandwidth=-1.0"),
    ({"alpha": math.nan}, "alpha=nan"),
    ({"threads": 0}, "whole number"),
    ({"threads": 2.5}, "whole number"),
    ({"sched": 1}, "True or False"),
    ({"ratio": True}, "ratio=True"),
    ({"log": "loud"}, "not a log level"),
    # Beyond 1e9 GB/s the model's bytes per second overflowed to inf: a traceback when the
    # Communicator was made, on every rank.
    ({"compress_gbps": 1e300}, "at most 1e\\+09 GB/s"),
    ({"add_gbps": "1e308"}, "CCOLL_ADD_GBPS='1e308' must be at most 1e\\+09 GB/s"),
])
def test_a_bad_value_is_refused_at_once_and_changes_nothing(kw, match):
    before = configure()
    with pytest.raises(InputError, match=match):
        configure(**kw)
    assert configure() == before


def test_an_unknown_name_is_a_type_error():
    with pytest.raises(TypeError, match="unknown ccoll setting"):
        configure(bandwith=1e9)


@pytest.mark.parametrize("forever", ["none", "inf", math.inf])
def test_a_timeout_of_forever_is_a_setting_not_a_removal(forever):
    # CCOLL_TIMEOUT=none waits forever (None); configure must not read it as "remove".
    assert configure(timeout=30).timeout == 30.0
    assert configure(timeout=forever).timeout is None
    assert parse({"CCOLL_TIMEOUT": "none"})[0].timeout is None
    assert configure(timeout=None).timeout == parse({})[0].timeout  # removed: the default


def test_an_empty_variable_is_unset_for_every_setting():
    # VAR= in a job script: unset for some settings, an error stopping the Communicator for
    # others (CCOLL_BANDWIDTH=, CCOLL_RATIO=, ...).
    from ccoll.settings import TABLE

    env = {var: "" for _, var, _, _, _ in TABLE}
    got, problems = parse(env)
    assert problems == [] and got == parse({})[0]
    env = {var: "  " for _, var, _, _, _ in TABLE}
    assert parse(env) == (got, [])


def test_a_huge_rate_from_the_environment_is_a_problem_not_a_crash():
    got, problems = parse({"CCOLL_COMPRESS_GBPS": "1e308", "CCOLL_DECOMPRESS_GBPS": "40"})
    assert problems == ["CCOLL_COMPRESS_GBPS='1e308' must be at most 1e+09 GB/s"]
    assert got.compress_gbps is None and got.decompress_gbps == 40.0
