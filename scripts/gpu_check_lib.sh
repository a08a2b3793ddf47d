# Sourced by gpu_check_1.sh and gpu_check_2.sh (not run alone): the set-up they share and
# `stage CAP NAME CMD...`, which runs CMD under a time cap of CAP seconds (a shell function
# of this file as `bash -c NAME`). Every command of a check runs in a stage, so a check's
# caps add up to its longest run:
# tests/test_gpu_scripts.py holds each script to 480 s (one device command may run 600 s,
# and a lent machine gives 15 minutes in all, start-up included). Bulky outputs go to
# $work; the figures are copied into $OUT (the device tool brings back 8 files at most),
# the rest packed into $OUT/details.tgz by `finish`.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/gpu_check}"
work="${GPU_CHECK_WORK:-/tmp/gpu_check_work}"
mkdir -p "$out" "$work"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the real kernels, compiled for the GPU
status=0
start=$SECONDS
: >"$out/stages.txt"

stage() {  # CAP NAME CMD...: CMD under `timeout CAP`, its output into log.txt
  local cap=$1 name=$2 began=$SECONDS rc
  shift 2
  echo "=== [$((SECONDS - start)) s] $name (cap $cap s)" | tee -a "$out/log.txt"
  timeout --kill-after=5 "$cap" "$@" 2>&1 | tee -a "$out/log.txt"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || status=1
  printf '%-48s cap %4d s  took %4d s  exit %d\n' "$name" "$cap" $((SECONDS - began)) "$rc" \
    | tee -a "$out/stages.txt"
}

install_wheels() {  # pytest and Ray from .gpu/whl (scripts/gpu_prepare.sh), once per machine
  python3 -c 'import pytest, ray' 2>/dev/null && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
}

environment() {
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton",
    triton.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
  nproc
  uptime
}

export -f install_wheels environment

keep() {  # SRC NAME: a figure file into $OUT, when the stage got as far as writing it
  [ -f "$1" ] && cp "$1" "$out/$2"
  return 0
}

finish() {
  echo "=== [$((SECONDS - start)) s] exit $status" | tee -a "$out/log.txt"
  tar -czf "$out/details.tgz" -C "$work" . 2>/dev/null
  ls -l "$out"
  exit $status
}
