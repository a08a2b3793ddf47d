#!/usr/bin/env bash
# Issue 13's GPU checks in one short run (a few minutes on one H200): the Triton attention,
# device sampler and decode-graph tests on cuda (the @pytest.mark.cuda ones too), then
# scripts/gpu_kernels.py: kernels against references at real sizes, timings against their
# peers and the bandwidth floor. From the project root on the GPU machine (no Ray needed):
#     bash scripts/gpu_check.sh            # logs and kernels.json into $OUT (or /tmp/gpu_check)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the real kernels, compiled for the GPU
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton",
  triton.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
status=0
python3 -m pytest -q -p no:cacheprovider tests/engine/test_triton_attention.py \
  tests/engine/test_device_sampler.py tests/engine/test_decode_graphs.py 2>&1 \
  | tee "$out/pytest.txt" || status=1
python3 scripts/gpu_kernels.py --out "$out" 2>&1 | tee "$out/kernels.txt" || status=1
echo "gpu_check: exit $status (logs in $out)"
exit $status
