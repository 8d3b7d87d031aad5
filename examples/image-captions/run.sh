#!/usr/bin/env bash
# Describe a small image corpus this script draws itself (coloured shapes, Pillow), through a
# vision-language model and real vLLM, locally. Without EXAMPLE_MODEL it builds the test suite's
# tiny random Idefics3 (the SmolVLM architecture, tests/support/tiny_vlm.py): its answers are
# noise, but every step is the real one. With EXAMPLE_MODEL=/path/to/SmolVLM-256M-Instruct (or
# another vision-language model vLLM runs) the captions are real.
#   EXAMPLE_ROWS=N   images to draw (default 40)
#   EXAMPLE_OUT=DIR  run directory (default: runs/image-captions-<rows>)
#   extra arguments are Hydra overrides
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
rows=${EXAMPLE_ROWS:-40}
out=${EXAMPLE_OUT:-runs/image-captions-$rows}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}

python "$here/make_images.py" "$out.input" --count "$rows"
model=${EXAMPLE_MODEL:-}
len=4096  # a real SmolVLM splits a picture into tiles: hundreds of tokens each
if [ -z "$model" ]; then
  model="$out.model"
  len=512  # the tiny model's whole context
  PYTHONPATH="$here/../..:$here/../../tests:${PYTHONPATH:-}" python "$here/../../tests/support/tiny_vlm.py" "$model"
fi
batchinfer run input.path="$out.input/images.jsonl" input.id_column=id input.columns=[shape,colour] \
  prompt.image_column=image 'prompt.template=What shape is in this picture, and what colour?' \
  model.path="$model" model.max_model_len="$len" model.enforce_eager=true sampling.max_tokens=24 \
  output.dir="$out" "$@"
python - "$out" <<'PY'
import pathlib, sys
import pyarrow.parquet as pq
rows = pq.read_table(pathlib.Path(sys.argv[1]) / "output.parquet").to_pylist()
for r in rows[:5]:
    print(r["id"], r["input"], "->", repr(r["text"]), r["prompt_tokens"], "prompt tokens")
print(f"{len(rows)} rows, {sum(r['error'] is not None for r in rows)} error rows")
PY
