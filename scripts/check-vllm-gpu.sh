#!/usr/bin/env bash
# Check the vLLM API that batchinfer/engine/vllm_engine.py uses against the GPU (CUDA) build of vLLM, on any
# machine, with or without a GPU: install `vllm==VERSION` alone into its own virtual environment
# (created once, reused after) and run scripts/vllm_contract.py with that environment's python.
# Nothing of batchinfer is installed there; the contract check imports only the standard library
# and vllm, and starts no engine.
#
#   scripts/check-vllm-gpu.sh            # vllm 0.33.0 in ~/.cache/batchinfer/venv-vllm-0.33.0
#   VLLM_VERSION=0.34.0 scripts/check-vllm-gpu.sh
#   BATCHINFER_GPU_VENV=/scratch/venv scripts/check-vllm-gpu.sh
#
# Environment: VLLM_VERSION (default 0.33.0), BATCHINFER_GPU_VENV (default
# ~/.cache/batchinfer/venv-vllm-$VLLM_VERSION), PYTHON (the interpreter the venv is made from,
# default python3). Costs, first run: about 9.5 GB of disk and 5-20 minutes. Exit code: the
# contract check's (1 if a check failed), or pip's.
set -euo pipefail

VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
VENV="${BATCHINFER_GPU_VENV:-$HOME/.cache/batchinfer/venv-vllm-$VLLM_VERSION}"
PYTHON="${PYTHON:-python3}"
HERE="$(cd "$(dirname "$0")" && pwd)"

# A pip configuration meant for the main environment must not shape this one (index settings,
# such as a site's mirror or proxy, and the certificate are kept):
# - a machine-wide constraint file (e.g. a torch cap in /etc/xdg/pip) would make the resolver fail
#   or pick other dependency versions than `vllm==X` pins; vLLM's own pins are what is checked here.
# - find-links folders may hold CPU builds of torch (`torch-X+cpu`), which sort above PyPI's
#   `torch-X` and would satisfy vLLM's `torch==X` pin with a torch without CUDA.
# pip ignores an empty value, so each is replaced by /dev/null: an empty constraints file, and a
# find-links location that is no folder (pip skips it, with a warning filtered below).
export PIP_CONSTRAINT=/dev/null PIP_FIND_LINKS=/dev/null

installed_version() {
    "$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null || true
}

if [[ "$(installed_version)" == "$VLLM_VERSION" ]]; then
    echo "reusing $VENV (vllm $VLLM_VERSION already installed)"
else
    mkdir -p "$(dirname "$VENV")"
    free_before_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print $4}')
    start=$(date +%s)
    [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
    echo "installing vllm==$VLLM_VERSION into $VENV (CUDA wheels: about 9.5 GB, 5-20 minutes)"
    # Index locations that a pip configuration names but that lack a package print one warning
    # per package; the rest of pip's output (errors included) is kept.
    "$VENV/bin/python" -m pip install --quiet "vllm==$VLLM_VERSION" 2>&1 |
        { grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory" || true; }
    end=$(date +%s)
    free_after_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print $4}')
    echo "install time: $((end - start)) s"
    echo "venv size: $(du -sh "$VENV" | cut -f1)"
    # The disk used in all: the venv plus whatever pip added to its cache.
    echo "disk used (free space before - after): $(((free_before_kb - free_after_kb) / 1024)) MiB"
fi

# Which torch the venv got: a CPU build would mean the check does not see what a GPU node runs.
# torch.cuda.is_available() only asks the driver: False on a machine without a GPU.
"$VENV/bin/python" -c '
import importlib.metadata as m
import sys
import torch
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| GPU visible:", torch.cuda.is_available(),
      "| transformers", m.version("transformers"))
if not torch.version.cuda:
    print("torch in this venv is not a CUDA build: remove the venv and run again")
    sys.exit(1)
' 2>/dev/null  # torch warns on stderr about the missing CUDA driver

# No GPU, CUDA driver or environment variable is needed: the check imports vllm's modules and
# inspects classes, it starts no engine and never initialises CUDA. Without an NVIDIA driver,
# vLLM's platform detection (NVML) finds no device and settles on UnspecifiedPlatform, which none
# of the checked imports minds. VLLM_TARGET_DEVICE is left alone: set to cpu it would make this
# CUDA build pick its CPU platform, and the check should see the CUDA build as a GPU node does.
start=$(date +%s)
rc=0
"$VENV/bin/python" "$HERE/vllm_contract.py" || rc=$?
echo "contract check: $(($(date +%s) - start)) s, exit $rc"
exit "$rc"
