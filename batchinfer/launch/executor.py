"""submitit's SlurmExecutor as batchinfer submits with it: sbatch under a timeout, and a step
whose Python holds USR2 pending from its first statement."""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from batchinfer import security
from batchinfer.launch import slurm
from batchinfer.redaction import redact_text, shell_refs

# sbatch waits for slurmctld to accept the job (and retries busy answers itself): allow longer
# than slurm.TIMEOUT_S.
SBATCH_TIMEOUT_S = 120.0


# The step's Python blocks USR2 as its first statement, then runs submitit's entry point: a
# preemption notice while the interpreter loads submitit and unpickles the task stays pending for
# the worker instead of killing the task by USR2's default action (or meeting submitit's handler).
# Only the interpreter's own start-up is left uncovered (`heal` resubmits a task killed there).
STEP_BOOT = (
    "import signal, sys, runpy; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2}); "
    "i = sys.argv.index('-m'); module = sys.argv[i + 1]; sys.argv = [sys.argv[0], *sys.argv[i + 2:]]; "
    "runpy.run_module(module, run_name='__main__', alter_sys=True)"
)


def step_python() -> str:
    """submitit's `python`: it appends `-u -m submitit.core._submit FOLDER`, which STEP_BOOT runs."""
    return f"{shlex.quote(sys.executable)} -u -c {shlex.quote(STEP_BOOT)}"


def make_executor(folder: Path, params: slurm.SlurmParameters) -> Any:
    """A submitit SlurmExecutor writing its scripts and logs under folder, its sbatch under a timeout."""
    ex = _timed_executor_class()(folder=folder, python=step_python())
    ex.update_parameters(**params)
    return ex


def script_text(text: str) -> str:
    """An sbatch script as stored in DIR/logs: redacted, a secret's value (or `${oc.env:NAME}`)
    left to the task's shell as ${NAME}, which --export hands the value."""
    return shell_refs(redact_text(text))


def write_script(path: Path, text: str) -> None:
    """Write an sbatch script, owner-only when it marks a secret's place (security.record_mode)."""
    mode = security.record_mode(path.parent, text)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


@functools.cache
def _timed_executor_class() -> type:
    """submitit's SlurmExecutor with sbatch run under SBATCH_TIMEOUT_S (submitit sets none).

    sbatch refusing raises CalledProcessError carrying sbatch's stderr; submitit's own runner
    would also print that stderr, and launch says it in one line instead."""
    import submitit
    import submitit.slurm.slurm as submitit_slurm
    from submitit.core import utils

    class TimedSlurmExecutor(submitit.SlurmExecutor):
        def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
            if len(delayed_submissions) == 1:
                return super()._internal_process_submissions(delayed_submissions)
            # submitit submits an array through a fresh executor made by the module-level name
            # SlurmExecutor: point that name here for the call, so the array's sbatch is timed too.
            plain = submitit_slurm.SlurmExecutor
            submitit_slurm.SlurmExecutor = TimedSlurmExecutor
            try:
                return super()._internal_process_submissions(delayed_submissions)
            finally:
                submitit_slurm.SlurmExecutor = plain

        def _submit_command(self, command: str) -> Any:
            # submitit 1.5's _submit_command, with sbatch run by subprocess.run under a timeout.
            tmp_uuid = uuid.uuid4().hex
            folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
            submission_file_path = folder / f".submission_file_{tmp_uuid}.sh"
            text = script_text(self._make_submission_file_text(command, tmp_uuid))
            write_script(submission_file_path, text)
            cmd = self._make_submission_command(submission_file_path)
            res = slurm.run_command(cmd, timeout=SBATCH_TIMEOUT_S)
            if res.returncode != 0:
                raise subprocess.CalledProcessError(res.returncode, cmd, res.stdout, res.stderr)
            job_id = self._get_job_id_from_submission_command(res.stdout)
            job = self.job_class(folder=self.folder, job_id=job_id, tasks=list(range(self._num_tasks())))
            job.paths.move_temporary_file(submission_file_path, "submission_file", keep_as_symlink=True)
            self._write_job_id(job.job_id, tmp_uuid)
            self._set_job_permissions(job.paths.folder)
            return job

    return TimedSlurmExecutor
