#!/usr/bin/env bash
# Here, before a GPU session: the pure-Python wheels gpu_check.sh needs that the lent GPU
# machine may lack (pytest and its needs), into .gpu/whl (git-ignored). Then call the device
# tool with carry [".gpu"] and `bash scripts/gpu_check.sh` (../shared/gpu/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/whl
if ! ls .gpu/whl/pytest-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl \
    pytest pluggy iniconfig packaging pygments
fi
du -sh .gpu | sed 's/^/carry .gpu: /'
