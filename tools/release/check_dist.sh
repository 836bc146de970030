#!/usr/bin/env bash
# Build gpupool's sdist, then its wheel from the sdist (as pip does), check what both hold
# (tools/release/check_dist.py), install the wheel with the test extra in a fresh virtual
# environment and run the tests of the unpacked sdist against it. Needs network (pip's isolated build
# fetches setuptools, Cython, cuda-bindings and nvidia-cuda-runtime) and a few minutes: too
# slow for .ci/run, whose test suite checks the installed package's metadata and modules
# instead (tests/test_packaging.py). WORK (default /tmp/gpupool-check-dist) holds everything.
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${WORK:-/tmp/gpupool-check-dist}
rm -rf "$WORK" && mkdir -p "$WORK"
python3 -m venv "$WORK/venv"
source "$WORK/venv/bin/activate"
python -m pip install -q --upgrade pip build

if ! python -m build --outdir "$WORK/dist" . > "$WORK/build.log" 2>&1; then
    tail -40 "$WORK/build.log"; echo "check_dist: the build FAILED (log: $WORK/build.log)"
    exit 1
fi
wheel=$(ls "$WORK"/dist/*.whl) sdist=$(ls "$WORK"/dist/*.tar.gz)
python tools/release/check_dist.py "$wheel" "$sdist"

tar -xzf "$sdist" -C "$WORK"
unpacked=$(ls -d "$WORK"/gpupool-*/)
python -m pip install -q "$wheel[test]" > "$WORK/install.log" 2>&1 \
    || { tail -40 "$WORK/install.log"; echo "check_dist: installing the wheel FAILED"; exit 1; }
# The tests and what they run come from the sdist; gpupool itself from the wheel: the sdist's
# package sources (no compiled modules) must not shadow it.
rm -r "$unpacked/gpupool"
cd "$unpacked"
python -m pytest -q -p no:cacheprovider tests
