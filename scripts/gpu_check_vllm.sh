#!/usr/bin/env bash
# engine.backend=vllm on a GPU machine that has vLLM (the lent machine has none, and the vllm
# wheel for its torch is too large to carry: docs/gpu_engine.md), one device command: the
# vLLM backend's tests (greedy parity with HF, weights checked in vLLM's worker, cache_salt
# isolation, abort and re-prefill, the engine worker's migrations as re-prefills) and a short
# `dorarl train --config configs/gpu-1.yaml engine.backend=vllm` (two vLLM instances and the
# trainer on one GPU, each instance taking the GPU share Ray placed it on).
#     # device tool: carry [".gpu"], command `bash scripts/gpu_check_vllm.sh`, timeout_s 540
# $OUT gets log.txt, stages.txt, train-vllm-summary.json and details.tgz (the rest).
source "$(dirname "$0")/gpu_check_lib.sh"

stage 40 "install wheels" bash -c install_wheels
stage 10 "environment" bash -c environment
stage 20 "vllm installed" python3 -c 'import vllm; print("vllm", vllm.__version__)'
[ "$status" -eq 0 ] || finish  # no vLLM here: nothing below can run
stage 180 "vllm backend tests" python3 -m pytest -q -p no:cacheprovider -rs tests/engine/vllm \
  tests/runtime/workers/test_engine_worker_vllm.py
stage 200 "train --config configs/gpu-1.yaml engine.backend=vllm steps=20" python3 -m \
  dorarl.cli train --config configs/gpu-1.yaml engine.backend=vllm steps=20 \
  checkpoint_every=0 eval.every=0 eval.max_prompts=50 progress=false --out "$work/train-vllm"
keep "$work/train-vllm/summary.json" train-vllm-summary.json
finish
