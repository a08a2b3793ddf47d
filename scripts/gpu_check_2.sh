#!/usr/bin/env bash
# The rest of the GPU check, a second device command (caps 480 s; run scripts/gpu_check_1.sh
# first, it matters more): `dorarl bench engine-device --device cuda --shape qwen2.5-7b --quick`;
# a migration between two engine actors on the GPU (CUDA IPC), its test then
# `dorarl bench migration --device cuda --shape qwen2-0.5b`; the SmolLM2
# arith config on cuda, where the converted model is on the machine ($SMOLLM2_DIR, default
# models/smollm2-135m-instruct: its 98 MB GGUF does not fit the 64 MiB a call carries, and
# the machine has no network, so without it the stage says so and is skipped).
#     # device tool: carry [".gpu"], command `bash scripts/gpu_check_2.sh`, timeout_s 540
# $OUT gets log.txt, stages.txt, engine-qwen2.5-7b.json, actor_migration.json,
# smollm2-summary.json and details.tgz (the rest).
source "$(dirname "$0")/gpu_check_lib.sh"
smollm2="${SMOLLM2_DIR:-models/smollm2-135m-instruct}"

stage 40 "install wheels" bash -c install_wheels
stage 10 "environment" bash -c environment
stage 150 "bench engine-device --device cuda --shape qwen2.5-7b --quick" python3 -m dorarl.cli \
  bench engine-device --device cuda --shape qwen2.5-7b --quick --out "$work/qwen2.5-7b"
keep "$work/qwen2.5-7b/engine.json" engine-qwen2.5-7b.json
keep "$work/qwen2.5-7b/engine.partial.json" engine-qwen2.5-7b.partial.json
stage 60 "kv migration between two engine actors (test)" python3 -m pytest -q \
  -p no:cacheprovider -rs tests/runtime/transfer/test_kv_transfer_cuda.py
stage 120 "bench migration" python3 -m dorarl.cli bench migration --device cuda \
  --shape qwen2-0.5b --out "$work/actor-migration"
keep "$work/actor-migration/actor_migration.json" actor_migration.json
if [ -f "$smollm2/config.json" ]; then
  stage 100 "train --config configs/smollm2-arith.yaml on cuda" python3 -m dorarl.cli train \
    --config configs/smollm2-arith.yaml "model=$smollm2" engine.device=cuda trainer.device=cuda \
    steps=10 checkpoint_every=0 eval.every=0 eval.max_prompts=50 progress=false \
    --out "$work/smollm2-arith"
  keep "$work/smollm2-arith/summary.json" smollm2-summary.json
else
  echo "=== smollm2 arith: skipped, no converted model at $smollm2" | tee -a "$out/log.txt"
fi
finish
