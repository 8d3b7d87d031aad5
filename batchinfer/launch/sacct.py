"""sacct's lines read by task (one parser): each array task's state, nodes, and whether USR2 killed it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from batchinfer import slurm_states


def array_indices(spec: str) -> list[int]:
    """The task indices of an array range as sacct and squeue print it: `[3-9]`, `[1,4-8:2%2]`."""
    out: list[int] = []
    for item in spec.strip("[]").split("%")[0].split(","):
        bounds, _, step = item.partition(":")
        first, _, last = bounds.partition("-")
        try:
            out += range(int(first), int(last or first) + 1, int(step or 1))
        except ValueError:
            continue  # a form this version does not know: those tasks keep the state squeue gives
    return out


USR2_NUMBER = "12"  # SIGUSR2 on Linux, as sacct prints it in ExitCode
# The columns read_sacct reads, in its order (a shorter prefix of them is read too).
SACCT_FIELDS = "JobID,State,ExitCode,NodeList"


@dataclass
class SacctTask:
    """One array task (A_T) or plain job as sacct's lines tell it."""

    # Its own line's state (of two, the later: a requeued task's runs, with -D), else its pending
    # range's (a range never overrides a task's own line); None: sacct listed only its steps.
    state: Optional[str] = None
    own: bool = False  # it has a line of its own
    steps: bool = False  # it has lines of steps (`A_T.batch`, `A_T.0`)
    # Killed by USR2: a line of it with signal 12 in its ExitCode (`0:12`: its batch shell or
    # step), or its own line FAILED with exit code 12 (srun passing on its task's death).
    usr2: bool = False
    # Its own line's NodeList ("node[1-2]": where it runs or ran); None before it has nodes.
    nodes: Optional[str] = None


def read_sacct(text: str) -> dict[str, SacctTask]:
    """`sacct -n -P -o JobID,State[,ExitCode[,NodeList]]` output (SACCT_FIELDS; -X or with steps)
    by task; a pending range (`A_[3-9%2]`: tasks not started yet) is expanded. Tasks are A_T, or a
    plain job id."""
    tasks: dict[str, SacctTask] = {}
    for line in text.splitlines():
        jid, state, code, nodelist = (line.strip().split("|") + ["", "", ""])[:4]
        state = state.split()[0] if state.strip() else ""  # "CANCELLED by 1000"
        task, _, step = jid.partition(".")
        array, _, index = task.partition("_")
        if index.startswith("["):
            for i in array_indices(index):
                ranged = tasks.setdefault(f"{array}_{i}", SacctTask())
                if not ranged.own:
                    ranged.state = state
            continue
        if not task:
            continue
        t = tasks.setdefault(task, SacctTask())
        status, _, sig = code.partition(":")
        t.usr2 = t.usr2 or sig == USR2_NUMBER or (not step and state == "FAILED" and status == USR2_NUMBER)
        if step:
            t.steps = True
        else:
            t.state, t.own = state, True
            t.nodes = nodelist if nodelist and not nodelist.startswith("None") else None  # "None assigned"
    return tasks


def task_endings(text: str) -> dict[str, str]:
    """{task: how its last run ended} from `sacct -n -P -o JobID,State,ExitCode` (steps included):
    "usr2" when killed by USR2 (SacctTask.usr2), "ended" for another end, "running" while the task
    has no final state (or accounting lags). A step killed by USR2 in a task still running (or
    queued again) is no death to heal: the task's own line decides whether it ended."""
    return {
        name: ("usr2" if t.usr2 else "ended") if t.own and t.state in slurm_states.FINAL else "running"
        for name, t in read_sacct(text).items()
        if t.own or t.steps
    }


def usr2_deaths(text: str) -> set[str]:
    """Tasks that sacct's lines show killed by USR2 (task_endings)."""
    return {task for task, how in task_endings(text).items() if how == "usr2"}
