"""Malformed objects from other libraries get a clear exception naming what is wrong, never a
crash (CPU, simulated device)."""

import numpy as np
import pytest

import gpupool
from gpupool.testing import SimulatedDevice


class Stream:
    def __init__(self, value):
        self.value = value

    def __cuda_stream__(self):
        return self.value


class Exporter:
    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


GOOD = {"data": (4096, False), "shape": (16,), "typestr": "|u1", "version": 3}


@pytest.mark.parametrize("value", [(), (0,), (1, 2, 3), None, 5])
def test_malformed_cuda_stream_protocol_is_a_type_error(pool, value):
    with pytest.raises(TypeError, match="__cuda_stream__"):
        pool.allocate(16, stream=Stream(value))
    buf = pool.allocate(16)
    with pytest.raises(TypeError, match="__cuda_stream__"):
        buf.record_stream(Stream(value))
    with pytest.raises(TypeError, match="__cuda_stream__"):
        buf.stream = Stream(value)


@pytest.mark.parametrize("max_version", [(), (1,), "x", (1, "0"), [1, 0]])
def test_malformed_dlpack_max_version_is_a_type_error(pool, max_version):
    buf = pool.allocate(16)
    with pytest.raises(TypeError, match="max_version"):
        buf.__dlpack__(max_version=max_version)


@pytest.mark.parametrize("change, error, field", [
    ({"data": ()}, TypeError, "data"),
    ({"data": (4096,)}, TypeError, "data"),
    ({"data": ("4096", False)}, TypeError, "data"),
    ({"data": (-1, False)}, ValueError, "data"),
    ({"data": (1 << 70, False)}, ValueError, "data"),
    ({"shape": (1 << 70,)}, ValueError, "shape"),
    ({"shape": (1 << 62, 1 << 62)}, ValueError, "shape"),
    ({"mask": object()}, ValueError, "mask"),
    ({"data": (0, False)}, ValueError, "null pointer"),
    ({"shape": (-1,)}, ValueError, "shape"),
    ({"shape": 16}, TypeError, "shape"),
    ({"typestr": 5}, TypeError, "typestr"),
    ({"strides": (1, 1)}, ValueError, "strides"),
    ({"stream": "x"}, TypeError, "stream"),
    ({"data": None, "shape": None, "typestr": None}, TypeError, "data"),
])
def test_malformed_array_interfaces_name_the_field(pool, change, error, field):
    exporter = Exporter({**GOOD, **change})
    with pytest.raises(error, match=field):
        gpupool.as_buffer(exporter, pool=pool)
    region = gpupool.Region(pool=pool)
    with region, pytest.raises(error, match=field):
        region.keep(exporter)


@pytest.mark.parametrize("cai, error, match", [
    ("not a dict", TypeError, "must be a dict"),
    ({"shape": (1,), "typestr": "|u1"}, ValueError, "no 'data'"),
])
def test_array_interface_that_is_no_dict_or_lacks_fields(pool, cai, error, match):
    with pytest.raises(error, match=match):
        gpupool.as_buffer(Exporter(cai), pool=pool)


def test_region_cache_cap_accepts_limit_strings(pool):
    region = gpupool.Region(pool=pool, max_cached_bytes="1MiB")
    with region:
        bufs = [pool.allocate(300_000) for _ in range(8)]     # 2.3 MiB of blocks
        del bufs
    assert region.stats().cached_bytes <= 1 << 20
    with pytest.raises(ValueError, match="^max_cached_bytes='lots': malformed memory limit"):
        gpupool.Region(pool=pool, max_cached_bytes="lots")


@pytest.mark.parametrize("value, error", [(-1, ValueError), ("-1", ValueError), (0, ValueError),
                                          (1.5, TypeError)])
def test_a_bad_region_cache_cap_names_its_argument_as_pools_limits_do(pool, value, error):
    with pytest.raises(error, match=rf"^max_cached_bytes={value!r}: "):
        gpupool.Region(pool=pool, max_cached_bytes=value)
    with pytest.raises(error, match=rf"^hard_limit={value!r}: "):
        gpupool.Pool(upstream=SimulatedDevice(), hard_limit=value)


@pytest.mark.parametrize("flag", ["skip_first", "debug", "trace"])
def test_a_regions_flags_are_bools(pool, flag):
    # 'yes' and 0 were taken as truth values: a typo turned a flag on or off unseen.
    for value in ("yes", 0, None):
        with pytest.raises(TypeError, match=rf"^{flag} must be a bool, got {value!r}$"):
            gpupool.Region(pool=pool, **{flag: value})
    assert getattr(gpupool.Region(pool=pool, **{flag: np.True_}), flag) is True


def test_plan_takes_numpys_bools_as_the_flags_do(pool):
    # Trial 34's finding 7: plan=np.True_ raised TypeError where the flags took it.
    assert gpupool.Region(pool=pool, plan=np.True_).planner is not None
    assert gpupool.Region(pool=pool, plan=np.False_).planner is None
    for value in (1, "yes", None):
        with pytest.raises(TypeError, match=r"^plan must be a bool or a dict"):
            gpupool.Region(pool=pool, plan=value)


def test_a_misspelt_keyword_names_the_class_not_cinit():
    # Python's own message named PoolBase.__cinit__ (trial 27).
    with pytest.raises(TypeError, match=r"^Pool\(\) got an unexpected keyword argument "
                                        r"'colour'$"):
        gpupool.Pool(upstream=SimulatedDevice(), colour=5)


@pytest.mark.parametrize("make, wrong, right", [
    (lambda **kw: gpupool.Pool(upstream=SimulatedDevice(), **kw), "hardlimit", "hard_limit"),
    (lambda **kw: gpupool.Pool(upstream=SimulatedDevice(), **kw), "softLimit", "soft_limit"),
    (lambda **kw: gpupool.Region(pool=gpupool.Pool(upstream=SimulatedDevice()), **kw),
     "maxcached_bytes", "max_cached_bytes"),
    (lambda **kw: gpupool.Region(pool=gpupool.Pool(upstream=SimulatedDevice()), **kw),
     "on_exits", "on_exit"),
])
def test_a_misspelt_keyword_names_the_closest_one(make, wrong, right):
    # Trial 29: the message now says which keyword was meant (difflib's closest).
    with pytest.raises(TypeError, match=rf"^\w+\(\) got an unexpected keyword argument "
                                        rf"'{wrong}'; did you mean '{right}'\?$"):
        make(**{wrong: 5})


@pytest.mark.parametrize("keyword, wrong, right", [
    ("scope", "proces", "process"), ("on_exit", "detatch", "detach"),
    ("collect", "yung", "young"),
])
def test_a_misspelt_choice_of_a_region_names_the_closest_one(pool, keyword, wrong, right):
    # Fresh-user trial: the keywords' "did you mean" did not reach their values.
    with pytest.raises(ValueError, match=rf"^{keyword} must be .*, got '{wrong}'; did you "
                                         rf"mean '{right}'\?$"):
        gpupool.Region(pool=pool, **{keyword: wrong})
    with pytest.raises(ValueError, match=rf"^{keyword} must be .*, got 'bogus'$"):
        gpupool.Region(pool=pool, **{keyword: "bogus"})       # nothing near: no guess


@pytest.mark.parametrize("keyword, wrong, right", [
    ("on_exit", "INVALIDATE", "'invalidate'"), ("on_exit", "Detatch", "'detach'"),
    ("scope", "Process", "'process'"), ("collect", "Full", "'full'"),
    ("collect", "None", "None"), ("collect", "none", "None"),
])
def test_a_choice_in_another_case_or_none_as_a_string_names_the_choice(pool, keyword, wrong,
                                                                        right):
    # Fresh-user trial: on_exit="INVALIDATE" had no guess (difflib compares case), and
    # collect="None" was offered nothing where the value None was meant.
    with pytest.raises(ValueError, match=rf"^{keyword} must be .*, got '{wrong}'; did you "
                                         rf"mean {right}\?$"):
        gpupool.Region(pool=pool, **{keyword: wrong})


def test_a_misspelt_strategy_of_a_regions_plan_names_the_closest_one(pool):
    # Fresh-user trial: the valid names were listed, the near one not named.
    with pytest.raises(ValueError, match=r"^strategies must be .* among \['area', .*\], got "
                                         r"\('sise',\): 'sise' is not one; did you mean "
                                         r"'size'\?$"):
        gpupool.Region(pool=pool, plan={"strategies": ("sise",)})
    with pytest.raises(ValueError, match=r": 'AREA' is not one; did you mean 'area'\?$"):
        gpupool.Region(pool=pool, plan={"strategies": ["size", "AREA"]})
    with pytest.raises(ValueError, match=r": 'bogus' is not one$"):     # nothing near
        gpupool.Region(pool=pool, plan={"strategies": ("bogus",)})


def test_a_misspelt_key_of_a_regions_plan_names_the_closest_one(pool):
    # Fresh-user trial: Region(plan={"max_plan": 3}) listed the keys without the near one.
    with pytest.raises(TypeError, match=r"^Region\(plan=\.\.\.\): unknown option 'max_plan'; "
                                        r"the accepted keys are max_plans, .*, repair; did "
                                        r"you mean 'max_plans'\?$"):
        gpupool.Region(pool=pool, plan={"max_plan": 3})
    with pytest.raises(TypeError, match=r"unknown option 'bogus', 'strategy'; .*; did you "
                                        r"mean 'strategies'\?$"):
        gpupool.Region(pool=pool, plan={"bogus": 1, "strategy": ["size"]})


def test_sleep_s_offload_and_a_region_s_name_have_their_types():
    # offload="yes" and name=5 were accepted (trial 29).
    pool = gpupool.Pool(upstream=SimulatedDevice(virtual_memory=True, page=4096))
    with gpupool.tag("w"):
        buf = pool.allocate(4096)
    for value in ("yes", 1, None):
        with pytest.raises(TypeError, match=rf"^offload must be a bool, got {value!r}$"):
            pool.sleep("w", offload=value)
    assert pool.stats().asleep_bytes == 0               # nothing slept
    pool.sleep("w", offload=np.True_)
    pool.wake("w")
    for value in (5, b"step", ["step"]):
        with pytest.raises(TypeError, match=r"^name must be a str or None, got "):
            gpupool.Region(pool=pool, name=value)
    assert "'step'" in repr(gpupool.Region(pool=pool, name="step"))
    assert gpupool.Region(pool=pool, name=None) is not None
    buf.close()


def test_a_regions_repr_says_whether_it_plans(pool):
    assert "plan=True" in repr(gpupool.Region(pool=pool, plan=True))
    assert "plan=False" in repr(gpupool.Region(pool=pool))


def test_a_stream_the_driver_refuses_is_an_error_for_allocations_not_for_frees(pool, sim):
    # The simulated device raises what the driver path does for the handle (cuStreamGetId's
    # CUDA_ERROR_INVALID_HANDLE through gpupool's CudaError); it raised ValueError (trial).
    stream = sim.create_stream()
    buf = pool.allocate(100, stream=stream)
    other = pool.allocate(100)
    sim.destroy_stream(stream)
    refused = r"^CUDA_ERROR_INVALID_HANDLE \(400\): simulated device: unknown or destroyed stream"
    for bad in (stream, 12345):                    # destroyed, never a stream
        with pytest.raises(gpupool.CudaError, match=refused):
            pool.allocate(100, stream=bad)
        with pytest.raises(gpupool.CudaError, match=refused):
            other.stream = bad
        with pytest.raises(gpupool.CudaError, match=refused):
            other.record_stream(bad)
    assert other.stream == 0
    del buf, other                                 # freeing a buffer whose stream is gone works
    assert pool.stats().in_use_bytes == 0
    sim.errors.clear()                             # the refused handles were this test's doing
