#!/usr/bin/env bash
# The engine's GPU checks and bench in one run (about 8-11 min on an H200; each stage capped):
#   1. the engine's cuda tests (exactness against HF, graph replay equals eager, weights
#      loaded in place under captured graphs, migration between two engines) and the Triton
#      kernel, device sampler and decode-graph tests, on cuda;
#   2. `dorarl bench engine --device cuda --shape qwen2-0.5b` (the bars' shape, full);
#   3. the same at qwen2.5-7b, --quick;
#   4. a migration between two engine actors on the GPU (CUDA IPC): its test, then
#      `dorarl bench engine --device cuda --shape qwen2-0.5b --actor-migration` (object_store
#      vs collective vs re-prefill at 1k/4k/16k tokens; needs Ray, which gpu_prepare.sh carries);
#   5. with GPU_CHECK_KERNELS=1 also scripts/gpu_kernels.py (the kernels alone, ~2 min).
# If a tiny Triton kernel cannot run here, the benches run with attention=torch and no
# graphs, and say so. Everything lands in $OUT (or /tmp/gpu_check): logs and engine JSONs.
#     bash scripts/gpu_prepare.sh          # here, once: pytest and Ray wheels into .gpu/ (43 MB)
#     bash scripts/gpu_check.sh            # there: device tool, carry [".gpu"]
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the real kernels, compiled for the GPU
if ! python3 -c 'import pytest, ray' 2>/dev/null && ls .gpu/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl 2>&1 | grep -v WARNING
fi
start=$SECONDS
stage() { echo "=== [$((SECONDS - start)) s] $*"; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton",
    triton.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
  nproc; uptime
} 2>&1 | tee "$out/env.txt"
status=0

stage "triton preflight"
engine_set=()
if ! timeout 60 python3 - <<'PY' 2>&1 | tee -a "$out/env.txt"; then
import torch
from dorarl.engine.triton_attention import paged_decode
q = torch.randn(2, 4, 64, device="cuda", dtype=torch.bfloat16)
k = torch.randn(4, 2, 16, 64, device="cuda", dtype=torch.bfloat16)
tables = torch.tensor([[0, 1], [2, 3]], device="cuda")
out = paged_decode(q, k, k.clone(), tables, torch.tensor([20, 5], device="cuda"))
torch.cuda.synchronize()
print("triton preflight ok", float(out.float().abs().sum()) > 0)
PY
  echo "triton cannot run here: benches use attention=torch, cuda_graphs=off" | tee -a "$out/env.txt"
  engine_set=(--engine-set attention=torch --engine-set cuda_graphs=off)
  status=1
fi

stage "cuda tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/engine/test_engine_cuda.py \
  tests/engine/test_triton_attention.py tests/engine/test_device_sampler.py \
  tests/engine/test_decode_graphs.py tests/engine/test_engine_fast_paths.py 2>&1 \
  | tee "$out/pytest.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

bench() {  # shape, time cap, extra flags
  local shape=$1 cap=$2
  shift 2
  stage "bench engine --device cuda --shape $shape $*"
  timeout "$cap" python3 -m dorarl.cli bench engine --device cuda --shape "$shape" \
    --out "$out/$shape" ${engine_set[@]+"${engine_set[@]}"} "$@" 2>&1 | tee "$out/bench-$shape.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
bench qwen2-0.5b 240
bench qwen2.5-7b 120 --quick

stage "kv migration between two engine actors on one GPU"
timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_kv_transfer_cuda.py 2>&1 \
  | tee "$out/pytest-kv-migration.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 150 python3 -m dorarl.cli bench engine --device cuda --shape qwen2-0.5b --actor-migration \
  --out "$out/actor-migration" 2>&1 | tee "$out/bench-actor-migration.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ "${GPU_CHECK_KERNELS:-0}" = 1 ]; then
  stage "gpu_kernels.py"
  timeout 200 python3 scripts/gpu_kernels.py --out "$out" 2>&1 | tee "$out/kernels.txt" || status=1
fi
stage "gpu_check: exit $status (files in $out)"
ls -R "$out"
exit $status
