#!/usr/bin/env bash
# Embed every public function of the Python standard library (the corpus of ../stdlib-topics)
# with all-MiniLM-L6-v2 through real vLLM, locally (no Slurm), then print the nearest neighbours
# of a few functions from the merged Parquet. Idempotent: a second run finds the finished run
# directory and only prints.
#   EXAMPLE_ROWS=N   only the first N functions (default: all, ~700)
#   EXAMPLE_OUT=DIR  run directory (default: runs/stdlib-search-<rows>)
#   EXAMPLE_QUERY="a.b c.d"  the functions whose neighbours are shown (default: show.py's list)
#   extra arguments are Hydra overrides, e.g. sharding.num_shards=2
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rows=${EXAMPLE_ROWS:-0}
out=${EXAMPLE_OUT:-runs/stdlib-search-${rows/#0/all}}

mkdir -p "$out.input"
python "$here/../stdlib-topics/make_corpus.py" "$out.input/functions.jsonl" --limit "$rows"
batchinfer prepare-model model=all-minilm-l6-v2
# The function's name and the first paragraph of its docstring, without the module: neighbours
# are then functions that do the same thing, whichever module they live in.
batchinfer run model=all-minilm-l6-v2 task=embed 'prompt.template={name}: {doc}' \
  input.path="$out.input/functions.jsonl" input.id_column=id output.dir="$out" "$@"
# shellcheck disable=SC2086  # EXAMPLE_QUERY is a list of ids
python "$here/show.py" "$out" ${EXAMPLE_QUERY:-}
