#!/usr/bin/env bash
# Here, before a GPU session: the wheels gpu_check_1.sh and gpu_check_2.sh need that the
# lent GPU machine lacks (pytest and its needs; Ray for the training run and the actor
# migration, its Java jar and the libraries we never import dropped so one call's 64 MiB
# carry holds it), into .gpu/whl (git-ignored). Then call the device tool twice with carry
# [".gpu"]: `bash scripts/gpu_check_1.sh`, then `bash scripts/gpu_check_2.sh`
# (../shared/gpu/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu/whl
if ! ls .gpu/whl/pytest-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/whl \
    pytest pluggy iniconfig packaging pygments
fi
if ! ls .gpu/whl/ray-*.whl >/dev/null 2>&1; then
  ray_version=$(python3 -c 'import ray; print(ray.__version__)' 2>/dev/null || echo 2.60.0)
  plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d .gpu/whl "ray==$ray_version" jsonschema jsonschema-specifications referencing rpds-py
  zip -q -d .gpu/whl/ray-*.whl 'ray/jars/*' 'ray/rllib/*' 'ray/serve/*' 'ray/llm/*' \
    'ray/dashboard/client/build/*' || true
fi
du -sh .gpu | sed 's/^/carry .gpu: /'
