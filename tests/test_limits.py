"""Parsing of memory limits."""

import pytest

from gpupool.limits import parse_limit


def total():
    return 80 * 1024**3


@pytest.mark.parametrize(
    "text, expected",
    [
        (1024, 1024), ("1024", 1024), ("512MiB", 512 * 1024**2), ("8GB", 8 * 1000**3),
        ("8 gb", 8 * 1000**3), ("1.5GiB", 3 * 1024**3 // 2), ("10kB", 10_000),
        ("10KiB", 10_240), ("50%", 40 * 1024**3), ("100%", 80 * 1024**3), ("3B", 3),
        (None, None),
    ],
)
def test_accepted_forms(text, expected):
    assert parse_limit(text, total) == expected


@pytest.mark.parametrize("text", ["", "abc", "10 XB", "-5MiB", "5%%", "0", "0%", "150%", "1e3"])
def test_malformed_limits_name_the_accepted_forms(text):
    with pytest.raises(ValueError) as info:
        parse_limit(text, total)
    assert "MiB" in str(info.value) or "positive" in str(info.value) or "%" in str(info.value)


@pytest.mark.parametrize("value", [1.5, True, [1]])
def test_wrong_types(value):
    with pytest.raises(TypeError):
        parse_limit(value, total)

