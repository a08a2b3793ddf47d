#!/usr/bin/env bash
# The GPU check that matters most, one device command (caps 480 s; scripts/gpu_check_2.sh
# is the rest): the engine's cuda tests (exact against HF, graph replay equals eager, the
# fast paths' start-up checks passing, weights loaded in place under captured graphs,
# migration between two engines) and the Triton kernel, device sampler and decode-graph
# tests; `dorarl bench engine-device --device cuda --shape qwen2-0.5b` (full); a short
# `dorarl train --config configs/gpu-1.yaml` (two engines and the trainer on one GPU).
# An engine whose Triton kernels or graphs fail their start-up check falls back and says
# so: the bench's engine JSON and the run's summary name it (fast_path_fallbacks).
#     bash scripts/gpu_prepare.sh    # here, once: pytest's and Ray's wheels into .gpu/
#     # device tool: carry [".gpu"], command `bash scripts/gpu_check_1.sh`, timeout_s 540
# $OUT gets log.txt (every stage's output), stages.txt (cap, time, exit of each),
# engine-qwen2-0.5b.json, train-summary.json and details.tgz (the rest).
source "$(dirname "$0")/gpu_check_lib.sh"

stage 40 "install wheels" bash -c install_wheels
stage 10 "environment" bash -c environment
stage 150 "cuda tests" python3 -m pytest -q -p no:cacheprovider -rs \
  tests/engine/test_engine_cuda.py tests/engine/test_triton_attention.py \
  tests/engine/test_device_sampler.py tests/engine/test_decode_graphs.py \
  tests/engine/test_engine_fast_paths.py
stage 190 "bench engine-device --device cuda --shape qwen2-0.5b" python3 -m dorarl.cli bench \
  engine-device --device cuda --shape qwen2-0.5b --out "$work/qwen2-0.5b"
keep "$work/qwen2-0.5b/engine.json" engine-qwen2-0.5b.json
keep "$work/qwen2-0.5b/engine.partial.json" engine-qwen2-0.5b.partial.json
stage 90 "train --config configs/gpu-1.yaml steps=20" python3 -m dorarl.cli train \
  --config configs/gpu-1.yaml steps=20 checkpoint_every=0 eval.every=0 eval.max_prompts=50 \
  progress=false --out "$work/train-gpu-1"
keep "$work/train-gpu-1/summary.json" train-summary.json
finish
