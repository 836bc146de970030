#!/usr/bin/env bash
# Make .ab-base/: the library of commit REV (its gpupool/ and build files, no tests), for
# tools/gpu/gpu-check.sh's ab step, which builds it in place on the GPU machine and runs
# bench/real_models.py against it beside this tree. .ab-base/ is git-ignored: name it in the
# device call's carry ([".whl", ".ab-base"]).
#   tools/gpu/ab-base.sh REV
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ $# -ne 1 ]; then
    echo "usage: tools/gpu/ab-base.sh REV (a commit, branch or tag to compare against)" >&2
    exit 2
fi
rev=$(git rev-parse --verify --quiet "$1^{commit}") || {
    echo "ab-base.sh: $1 names no commit here" >&2; exit 2; }
rm -rf .ab-base && mkdir .ab-base
git archive "$rev" gpupool setup.py setup.cfg pyproject.toml README.md LICENSE MANIFEST.in |
    tar -x -C .ab-base
echo "$rev" > .ab-base/REV
echo ".ab-base: $rev ($(du -sh .ab-base | cut -f1)); carry it with .whl"
