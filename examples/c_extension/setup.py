"""Build the example: ``python setup.py build_ext --inplace`` (needs gpupool installed; no CUDA
toolkit: only gpupool's header, found with ``gpupool.get_include()``)."""

from setuptools import Extension, setup

import gpupool

setup(
    name="gpupool-scratch-example",
    ext_modules=[
        Extension("gpupool_scratch", ["scratch.c"], include_dirs=[gpupool.get_include()]),
    ],
)
