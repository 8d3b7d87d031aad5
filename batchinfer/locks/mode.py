"""The lock mode a run directory configures (`output.lock`: auto | flock | file), read from its
run.yaml by the callers that know the run directory; the locks take it as an argument."""

from __future__ import annotations

import time
from pathlib import Path

import yaml

from batchinfer.errors import TransientRunDirError

LOCK_MODES: tuple[str, ...] = ("auto", "flock", "file")  # output.lock's choices (config/checks.py)
# A run.yaml that cannot be read is read again after these waits (seconds) before the lock is
# refused: its output.lock decides the mechanism, and guessing "auto" could mix two.
RUN_YAML_RETRY_WAITS = (0.5, 2.0)


def configured_mode(run_dir: Path) -> str:
    """output.lock from DIR/run.yaml, read now (a resume may have changed it): "auto" only when
    there is no run.yaml (older run directories) or it names none. A run.yaml that cannot be read
    or parsed now is read again, then refused: guessing "auto" would take flock beside tasks that
    use lock files."""
    path = run_dir / "run.yaml"
    problem = ""
    for wait in (*RUN_YAML_RETRY_WAITS, None):
        try:
            run = yaml.safe_load(path.read_text())
            if run is None or isinstance(run, dict):
                break
            problem = "it is not a mapping"
        except FileNotFoundError:
            return "auto"
        except OSError as e:
            problem = f"it cannot be read: {e.strerror or e}"
        except yaml.YAMLError as e:
            problem = f"it is not valid YAML: {str(e).splitlines()[0]}"
        if wait is None:
            raise TransientRunDirError(  # an NFS hiccup passes: the shard loop retries
                f"{path}: {problem}. Its output.lock decides how shards are locked, so nothing is "
                "written; check the file (and the filesystem) and run again"
            )
        time.sleep(wait)
    mode: object = run
    for key in ("config", "output", "lock"):  # another tool's run.yaml may hold anything there
        mode = mode.get(key) if isinstance(mode, dict) else None
    return str(mode or "auto")
