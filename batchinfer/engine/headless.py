"""A node after the first of an engine over several nodes (cluster.nodes_per_task): what the task's
`srun` step runs on each of them (launch/ranks.py starts it). It reads the run's config, never
writes the run directory, and runs vLLM's headless executor (vllm_engine.run_headless) until the
head stops its step, or the job ends.

    python -m batchinfer.engine.headless DIR MASTER_ADDR MASTER_PORT NNODES DTYPE ENGINE_ARGS

ENGINE_ARGS: the engine arguments the head resolved (JSON), so every node runs with its values.
It exits when one of its workers has exited (a step that raised ends the worker): its step ends,
and the head fails its engine.
Its node rank is its task's rank in the step plus one (the head is node 0)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Optional

log = logging.getLogger("batchinfer")


def main(argv: Optional[list[str]] = None) -> None:
    """Run this node's engine ranks."""
    # Slurm's --signal=USR2 (the time limit) reaches every step of the job: the head decides what
    # it means, and stops this step itself. The engine's processes inherit the mask.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    from batchinfer.config.nodes import NodeGroup
    from batchinfer.engine.vllm_engine import run_headless
    from batchinfer.logs import setup_logging
    from batchinfer.rundir.store import RunDir

    setup_logging()
    run_dir, addr, port, nnodes, dtype, engine_args = (argv if argv is not None else sys.argv[1:])[:6]
    node_rank = int(os.environ.get("SLURM_PROCID", "0")) + 1
    nodes = NodeGroup(int(nnodes), addr, int(port), engine_args=json.loads(engine_args))
    log.info(
        "node %s: engine ranks of node %d of %d, meeting the head at %s:%s",
        os.environ.get("SLURMD_NODENAME", "?"),
        node_rank,
        nodes.nnodes,
        addr,
        port,
    )
    if run_headless(RunDir(run_dir).config, dtype, nodes, node_rank):
        log.error("node %d: a worker of this node's engine ranks died: the engine over the nodes fails", node_rank)
        # At once: the interpreter's teardown (vLLM's exit handlers) took 20 s here, and the head
        # waits for this step's end to know its engine failed for this node, not for its rows.
        logging.shutdown()
        os._exit(1)
    log.info("node %d: the engine's ranks have exited", node_rank)


if __name__ == "__main__":  # vLLM spawns its workers: they import this module without running it
    main()
