"""The head of one vLLM engine over two ranks on this machine (both at 127.0.0.1; the other rank is
`python -m batchinfer.engine.headless`, started and watched by launch/ranks.RankStep as it starts
`srun` on a cluster), for tests/engine/test_two_ranks.py. It sends one step of more prompt tokens
than the ranks' own default allows, then steps on until the engine fails (BATCHINFER_RANK_RAISE
makes the other rank's worker raise), and writes what it saw as JSON.

    python tests/support/two_ranks_head.py DIR OUT.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROWS = 64  # rows of the big step: each ~100 prompt tokens, more than 4096 together


def main() -> None:
    from batchinfer.engine.vllm_engine import Engine, head_defaults
    from batchinfer.launch import ranks
    from batchinfer.logs import setup_logging
    from batchinfer.rundir.store import RunDir

    setup_logging()
    run_dir, out = sys.argv[1:3]
    run = RunDir(run_dir)
    step = ranks.RankStep(run, ["localhost", "other-node"], "localhost", head_defaults)
    step.cmd = [*ranks.HEADLESS, *step.cmd[len(step.cmd) - 6 :]]  # the rank here, not through srun
    seen: dict = {"engine_args": step.group.engine_args}
    step.start()
    engine = Engine(run.config, step.cmd[-2], step.group)
    try:
        params = engine.sampling_params(dict(dataclasses.asdict(run.config.sampling), max_tokens=1))
        for i in range(ROWS):
            text = f"row {i:03d}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(30))
            engine.add(f"big-{i}", engine.encode(text)[:110], params)
        per_step = []
        while engine.has_unfinished():
            per_step.append(sum(c.prompt_tokens for c in engine.step()))
        seen["big_step_tokens"] = max(per_step)
        seen["steps"] = len(per_step)
        n = 0
        try:
            while n < 1000:  # the other rank raises at its BATCHINFER_RANK_RAISE-th step
                if not engine.has_unfinished():
                    for k in range(4):
                        engine.add(f"more-{n}-{k}", engine.encode(f"more rows {n} {k}"), params)
                engine.step()
                n += 1
            seen["error"] = None
        except Exception as e:
            seen["error"] = f"{type(e).__name__}: {e}"
        step._watcher.join(60)
        seen["died"] = step.died
        seen["rank_exit"] = step.proc.returncode if step.proc is not None else None
    finally:
        step.stop()
        engine.close()
    Path(out).write_text(json.dumps(seen))


if __name__ == "__main__":  # vLLM spawns its processes: they import this file without running it
    main()
