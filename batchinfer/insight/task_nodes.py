"""The nodes of a running or failed array task in `status`: sacct's NodeList of the task
(launch/slurm.job_states), shown so a user can look at the node a task failed on, or every node of
an engine spanning several (cluster.nodes_per_task)."""

from __future__ import annotations

from typing import Optional

from batchinfer.launch.jobs import ShardTask

SHOWN_STATES = ("running", "failed")


def task_nodes(nodes: dict[str, str], job: str) -> Optional[str]:
    """The nodes sacct lists for array task A_T; a one-task array is the plain job A to Slurm."""
    array, _, index = job.rpartition("_")
    return nodes.get(job) or (nodes.get(array) if array and index == "0" else None)


def shard_nodes(state: str, task: Optional[ShardTask], nodes: Optional[dict[str, str]]) -> Optional[str]:
    """The nodes of a shard's task while it runs or after it failed; None otherwise or unknown."""
    if state not in SHOWN_STATES or not task or not nodes:
        return None
    return task_nodes(nodes, task["job"])


def nodes_note(nodes: Optional[str]) -> str:
    """`on node[1-2]` for a status line (nodes: a shard's, shard_nodes), or nothing."""
    return f"on {nodes}" if nodes else ""
