"""The parent's side of a trial process: start it with the setting's environment, tell it to go
on or stop, read its JSON lines under a deadline, and kill its whole process group when over time."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional

from batchinfer.durable import write_record
from batchinfer.redaction import carried, exact_json
from batchinfer.tune.halving import Rung, TrialFailed
from batchinfer.tune.settings import Setting


def trial_env(setting: Setting) -> dict[str, str]:
    """A trial's environment: this one with the setting's variables, without the Slurm job identity
    (inside a tune job, a trial's failed rung or a stop signal must not requeue the tune job)."""
    from batchinfer.slurm_env import without_job

    return {**without_job(os.environ), **carried(), **setting.env}  # carried: the secrets the spec leaves out


class TrialProcess:
    """`python -m batchinfer.tune.trial SPEC` for one setting (see batchinfer/tune/trial.py)."""

    def __init__(self, setting: Setting, spec: dict[str, Any], folder: Path):
        self.setting = setting
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        # the trial composes from it: exactly what runs but a secret's value (carried in its environment)
        write_record(folder / "spec.json", exact_json(spec, indent=2))
        self.proc: Optional[subprocess.Popen[str]] = None
        self.lines: queue.Queue[Optional[str]] = queue.Queue()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _answer(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            self._kill()
            raise TrialFailed(f"over its time: {what} took more than {timeout:.0f} s") from None
        if line is None:
            code = self.proc.wait() if self.proc else None
            raise TrialFailed(f"the trial process died during {what} (exit {code}; see {self.folder / 'trial.log'})")
        msg = json.loads(line)
        if msg["event"] == "failed":
            raise TrialFailed(msg["reason"])
        return msg

    def start(self, timeout: float) -> Optional[float]:
        """Start the process and its engine; the engine's start-up seconds (None: a task of several
        engines, started for each rung)."""
        env = trial_env(self.setting)
        log = open(self.folder / "trial.log", "w", encoding="utf-8")  # noqa: SIM115  (the child keeps it)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "batchinfer.tune.trial", str(self.folder / "spec.json")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: a kill reaches vLLM's engine core too
        )
        log.close()
        threading.Thread(target=self._read, daemon=True).start()
        startup = self._answer(timeout, "engine start")["startup_seconds"]
        return None if startup is None else float(startup)

    def rung(self, index: int, timeout: float) -> Rung:
        """Run rung `index` on the engine already started."""
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"go {index}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise TrialFailed(f"the trial process had exited (see {self.folder / 'trial.log'})") from None
        msg = self._answer(timeout, f"rung {index}")
        msg.pop("event")
        return Rung.from_json(msg)

    def stop(self) -> None:
        """Tell it to close its engine and wait; kill the group when it does not go."""
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
            pass
        self._kill()

    def _kill(self) -> None:
        """SIGKILL the trial's process group (also an engine-core process its exit left behind) and
        the groups of its descendants: a task's engine processes have groups of their own."""
        import psutil

        if self.proc is None:
            return
        groups = {self.proc.pid}
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            descendants = []
        for p in descendants:
            try:
                groups.add(os.getpgid(p.pid))
            except ProcessLookupError:
                pass
        groups.discard(os.getpgrp())  # never this process's own group
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
