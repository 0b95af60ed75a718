"""ccoll.units: sizes, rates and times as people type them; b is a bit, B a byte."""

from __future__ import annotations

import argparse

import pytest
from kit import assert_clear_error

from ccoll import units
from ccoll.errors import InputError, UnitError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(("text", "value"), [
    ("4", 4), ("64K", 64 * KiB), ("64k", 64 * KiB), ("64M", 64 * MiB), ("64m", 64 * MiB),
    ("1G", GiB), ("1T", 1 << 40),
    ("256MiB", 256 * MiB), ("1KiB", KiB), ("2GiB", 2 * GiB),
    ("64MB", 64_000_000), ("1kB", 1000), ("1KB", 1000), ("1GB", 10**9),
    ("100B", 100), ("100 bytes", 100), ("1.5K", 1536), (" 8M ", 8 * MiB), ("1e3", 1000),
])
def test_parse_size(text: str, value: int) -> None:
    assert units.parse_size(text) == value


@pytest.mark.parametrize(("bad", "match"), [
    ("fast", "size must look like"), ("-3", "whole, finite number"), ("1.5", "whole, finite"),
    ("1e400", "whole, finite number"), ("1e300T", "whole, finite number"),
    ("64Mb", "in bytes, not bits"), ("64b", "in bytes, not bits"),
    ("64mB", "milli"), ("64MQ", "size must look like"), ("64 MiBs", "size must look like"),
])
def test_parse_size_rejects(bad: str, match: str) -> None:
    assert_clear_error(UnitError, match, units.parse_size, bad)


@pytest.mark.parametrize(("text", "bytes_per_s"), [
    # bits
    ("10Gbit", 1.25e9), ("10Gbit/s", 1.25e9), ("10Gbits/s", 1.25e9), ("10Gb", 1.25e9),
    ("10Gb/s", 1.25e9), ("10Gbps", 1.25e9), ("10GBit", 1.25e9), ("10GBIT/s", 1.25e9),
    ("1gbit", 1.25e8), ("500mbit", 6.25e7), ("500Mbit", 6.25e7), ("100Kbps", 12_500),
    ("100Kbit", 12_500), ("1Tbit", 1.25e11), ("8bit/s", 1.0), ("1Gibit", GiB / 8),
    # bytes
    ("10GB/s", 1e10), ("10GB", 1e10), ("10GBps", 1e10), ("1.25GB/s", 1.25e9),
    ("1GiB/s", GiB), ("1MiB", MiB), ("3B/s", 3.0), ("2 bytes/s", 2.0), ("1Gbyte/s", 1e9),
    ("1e3MB/s", 1e9),
])
def test_parse_rate(text: str, bytes_per_s: float) -> None:
    assert units.parse_rate(text) == pytest.approx(bytes_per_s, rel=1e-15)


def test_bytes_and_bits_differ_by_eight() -> None:
    # The bug this module fixes: the unit's case was ignored and 10GB/s read as 10 Gbit/s.
    assert units.parse_rate("10GB/s") == 8 * units.parse_rate("10Gb/s") == 1e10


@pytest.mark.parametrize(("bad", "match"), [
    ("10G", "has no unit: bits or bytes"),
    ("1e9", "has no unit"),
    ("100mbps", "ambiguous: tc reads 'mbps' as MB/s.*write 100Mbit or 100MB/s"),
    ("1gbps", "ambiguous"),
    ("100kbps", "ambiguous"),
    ("10gb", "write the prefix as 'G'"),
    ("10mB/s", "write the prefix as 'M'"),
    ("10GBPS", "unknown unit 'BPS'"),
    ("10Gbytes/sec", "unknown unit"),
    ("1 gigabit", "unknown unit"),
    ("fast", "must look like 10Gbit or 1.25GB/s"),
    ("0Gbit", "must be > 0"),
    ("-1Gbit", "must be > 0"),
])
def test_parse_rate_rejects_ambiguous_and_unknown(bad: str, match: str) -> None:
    assert_clear_error(UnitError, match, units.parse_rate, bad)


def test_rate_messages_name_the_quantity_and_the_expected_form() -> None:
    with pytest.raises(UnitError) as info:
        units.parse_rate("10G", what="rate")
    assert str(info.value).startswith("rate '10G'")
    assert "must look like 10Gbit or 1.25GB/s (b = bit, B = byte)" in str(info.value)


def test_numbers_are_bytes_per_second() -> None:
    assert units.parse_rate(1.5e9) == 1.5e9
    assert_clear_error(UnitError, "> 0", units.parse_rate, 0.0)


@pytest.mark.parametrize(("text", "seconds"), [
    ("5us", 5e-6), ("5µs", 5e-6), ("5μs", 5e-6), ("0.2ms", 2e-4), ("1e-6", 1e-6),
    ("3ns", 3e-9), ("2s", 2.0), ("0", 0.0),
])
def test_parse_time(text: str, seconds: float) -> None:
    assert units.parse_time(text) == pytest.approx(seconds, rel=1e-15)


@pytest.mark.parametrize("bad", ["5 parsecs", "5MS", "fast", "-1us"])
def test_parse_time_rejects(bad: str) -> None:
    assert_clear_error(UnitError, "time must", units.parse_time, bad)


def test_unit_errors_are_input_errors_that_argparse_shows() -> None:
    assert issubclass(UnitError, InputError) and issubclass(UnitError, ValueError)
    ap = argparse.ArgumentParser(prog="x", exit_on_error=False)
    ap.add_argument("--bandwidth", type=units.parse_rate)
    with pytest.raises(argparse.ArgumentError) as info:
        ap.parse_args(["--bandwidth", "10G"])
    # argparse shows "invalid parse_rate value" for a plain ValueError.
    assert "must look like 10Gbit" in str(info.value)


@pytest.mark.parametrize(("n", "text"), [
    (0, "0"), (1000, "1000"), (1024, "1K"), (1536, "1.5K"), (64 * MiB, "64M"), (GiB, "1G"),
])
def test_format_size_reads_back(n: int, text: str) -> None:
    assert units.format_size(n) == text
    assert units.parse_size(text) == n


@pytest.mark.parametrize(("n", "text"), [(100, "100 B"), (64 * MiB, "64 MiB"), (1536, "1.5 KiB")])
def test_format_iec(n: int, text: str) -> None:
    assert units.format_iec(n) == text


@pytest.mark.parametrize(("n", "text"), [
    (None, "-"), (576, "576 B"), (18432, "18.43 kB"), (17_490_000, "17.49 MB"),
])
def test_format_bytes(n: int | None, text: str) -> None:
    assert units.format_bytes(n) == text


@pytest.mark.parametrize(("s", "text"), [(5e-5, "50.0 us"), (0.0123, "12.30 ms"), (2, "2.000 s")])
def test_format_time(s: float, text: str) -> None:
    assert units.format_time(s) == text
