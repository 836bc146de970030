"""Parsing of memory limits, from arguments and from the environment (CPU, simulated device)."""

import numpy as np
import pytest

import gpupool
from gpupool.limits import parse_limit
from gpupool.testing import SimulatedDevice


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



@pytest.mark.parametrize("value", [np.int64(1 << 20), np.uint32(1 << 20), np.int8(64)])
def test_numpys_integers_are_taken(value):
    # helper-115's finding: Pool(hard_limit=np.int64(...)) raised TypeError, while
    # pool.allocate(np.int64(...)) takes one.
    assert parse_limit(value, total) == int(value) and type(parse_limit(value, total)) is int


@pytest.mark.parametrize("argument", ["hard_limit", "soft_limit", "max_cached_bytes"])
def test_a_limit_past_a_size_t_is_named(sim, argument):
    # helper-115's finding: 2**80 raised a bare OverflowError naming no argument.
    with pytest.raises(ValueError, match=rf"^{argument}={2**80}: a memory limit must be "
                                         r"below 2\*\*64 bytes"):
        if argument == "max_cached_bytes":
            gpupool.Region(pool=gpupool.Pool(upstream=sim), max_cached_bytes=2**80)
        else:
            gpupool.Pool(upstream=sim, **{argument: 2**80})
    assert parse_limit((1 << 64) - 1, total) == (1 << 64) - 1


LIMITS = [("hard_limit", "GPUPOOL_HARD_LIMIT"), ("soft_limit", "GPUPOOL_SOFT_LIMIT")]


@pytest.mark.parametrize("argument, variable", LIMITS)
def test_a_malformed_variable_is_named_with_its_value(sim, monkeypatch, argument, variable):
    monkeypatch.setenv(variable, "lots")
    with pytest.raises(ValueError, match=f"^{variable}='lots': malformed memory limit 'lots'"):
        gpupool.Pool(upstream=sim)
    with pytest.raises(ValueError, match=f"^{argument}='lots': malformed memory limit"):
        gpupool.Pool(upstream=sim, **{argument: "lots"})


@pytest.mark.parametrize("argument, variable", LIMITS)
def test_minus_one_reads_the_same_through_the_variable_and_the_argument(sim, monkeypatch,
                                                                       argument, variable):
    with pytest.raises(ValueError) as by_argument:
        gpupool.Pool(upstream=sim, **{argument: -1})
    monkeypatch.setenv(variable, "-1")
    with pytest.raises(ValueError) as by_variable:
        gpupool.Pool(upstream=sim)
    assert str(by_argument.value) == f"{argument}=-1: a memory limit must be positive, got -1"
    assert str(by_variable.value) == \
        f"{variable}='-1': a memory limit must be positive, got '-1'"


def test_a_soft_limit_above_the_hard_limit_is_refused(sim, monkeypatch):
    with pytest.raises(ValueError, match=r"soft limit soft_limit='2MiB' \(2.000 MiB\) is above "
                                         r"the hard limit hard_limit='1MiB' \(1.000 MiB\)"):
        gpupool.Pool(upstream=sim, hard_limit="1MiB", soft_limit="2MiB")
    monkeypatch.setenv("GPUPOOL_SOFT_LIMIT", "2MiB")
    with pytest.raises(ValueError, match="GPUPOOL_SOFT_LIMIT='2MiB'.* hard_limit=1048576"):
        gpupool.Pool(upstream=sim, hard_limit=1 << 20)
    pool = gpupool.Pool(upstream=sim, hard_limit="2MiB")          # equal limits are fine
    assert pool.soft_limit == pool.hard_limit == 2 << 20
    assert gpupool.Pool(upstream=sim, hard_limit=None).soft_limit == 2 << 20   # no hard limit


def test_signs_are_read():
    assert parse_limit("+1MiB", total) == 1 << 20
    for text in ("-1", "-0.5GiB", "-50%"):
        with pytest.raises(ValueError, match="positive|percentage"):
            parse_limit(text, total)


def test_the_simulated_device_takes_sizes_as_the_limits_do():
    sim = SimulatedDevice(capacity="1GiB", page="64KiB")
    assert sim.capacity == 1 << 30 and sim.page == 64 << 10
    assert SimulatedDevice(capacity="1.5 GB").capacity == 1_500_000_000
    for bad, error, match in [("50%", ValueError, "not a percentage"),
                              ("lots", ValueError, "capacity='lots': malformed"),
                              (0, ValueError, "capacity=0: a memory limit must be positive"),
                              (1.5, TypeError, "capacity=1.5")]:
        with pytest.raises(error, match=match):
            SimulatedDevice(capacity=bad)
    with pytest.raises(ValueError, match="multiple of 512"):
        SimulatedDevice(page=1000)
