"""One vLLM engine over two ranks on this machine, as over two nodes (the two-node Slurm cluster's
test is tests/slurm/test_multinode.py): the head resolves the engine's arguments and every rank runs
with them, so a step of more tokens than a rank's own default runs; a rank whose worker raises ends,
and the head's engine fails (instead of waiting on that worker for ever). Real vLLM: it is vLLM's
processes that are proven. The head is a process of its own: the head kills its engine's processes
when its ranks end, and here that must not reach the session's shared engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support import REPO
from support.corpus import write_corpus
from support.runs import model_overrides

from batchinfer.config.compose import compose
from batchinfer.rundir.prepare import prepare


def test_a_step_beyond_the_ranks_default_runs_and_a_raising_rank_fails_the_engine(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 4)
    overrides = [
        f"input.path={corpus}",
        f"output.dir={tmp_path / 'run'}",
        *model_overrides(tiny_model_path),
        "model.max_num_seqs=null",  # vLLM's default: the head's 512, every row of the big step at once
        "model.dtype=float32",
        "model.tensor_parallel_size=2",
        "cluster=slurm",
        "cluster.gpus_per_task=0",
        "cluster.nodes_per_task=2",
    ]
    run = prepare(compose(overrides))
    out = tmp_path / "seen.json"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", BATCHINFER_RANK_RAISE="6", SLURM_JOB_ID="611")
    head = subprocess.run(
        [sys.executable, str(REPO / "tests" / "support" / "two_ranks_head.py"), str(run.path), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    (tmp_path / "head.log").write_text(head.stderr)
    assert head.returncode == 0, head.stderr[-3000:]
    seen = json.loads(out.read_text())
    # resolved on the head: the offline engine's 8192 (4096 x 2 ranks on CPU); a rank left to itself took 4096
    assert seen["engine_args"]["max_num_batched_tokens"] == 8192
    assert seen["big_step_tokens"] > 4096, seen
    assert "BATCHINFER_RANK_RAISE=6: this rank's step raises" in head.stderr
    assert "a step raised; this worker exits so the engine fails" in head.stderr
    # the head's engine failed: vLLM's own EngineDeadError, or the watchdog's, whichever saw it first
    assert seen["error"] is not None and ("EngineDeadError" in seen["error"] or "engine core died" in seen["error"])
    assert seen["died"] == "the engine ranks on other-node exited (srun exit status 1)" and seen["rank_exit"] == 1
