"""What earlier versions left behind still works after the stage packages: a job queued by
submitit (a pickle naming `batchinfer.launch.slurm_task` / `slurm_merge`) runs the current
function, and a run.yaml written by 0.1.0 before the restructure reproduces its fingerprint
and loads into the typed config."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import yaml
from submitit.core.utils import DelayedSubmission

import batchinfer.launch
from batchinfer.config.fingerprint import fingerprint, fingerprint_keys
from batchinfer.config.schema import Config, to_config
from batchinfer.rundir.store import RunDir

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RUN_0_1_0 = FIXTURES / "run-0.1.0.yaml"

# The bytes of `DelayedSubmission(slurm_task, "DIR", [0]).dump(...)` (cloudpickle, protocol 5,
# what submitit writes into the job folder) made by batchinfer 0.1.0 before the stage packages
# (commit deb5194, where slurm_task was defined in batchinfer/launch.py), with submitit 1.5.4.
OLD_TASK_SUBMISSION = (
    b"\x80\x05\x95\xbe\x00\x00\x00\x00\x00\x00\x00\x8c\x13submitit.core.utils\x94\x8c\x11DelayedSubmission"
    b"\x94\x93\x94)\x81\x94}\x94(\x8c\x08function\x94\x8c\x11batchinfer.launch\x94\x8c\nslurm_task\x94\x93"
    b"\x94\x8c\x04args\x94\x8c\x03DIR\x94]\x94K\x00a\x86\x94\x8c\x06kwargs\x94}\x94\x8c\x07_result\x94N"
    b"\x8c\x05_done\x94\x89\x8c\x0c_timeout_min\x94K\x00\x8c\x12_timeout_countdown\x94K\x00ub."
)
OLD_MERGE_SUBMISSION = (
    b"\x80\x05\x95\xba\x00\x00\x00\x00\x00\x00\x00\x8c\x13submitit.core.utils\x94\x8c\x11DelayedSubmission"
    b"\x94\x93\x94)\x81\x94}\x94(\x8c\x08function\x94\x8c\x11batchinfer.launch\x94\x8c\x0bslurm_merge\x94"
    b"\x93\x94\x8c\x04args\x94\x8c\x03DIR\x94\x85\x94\x8c\x06kwargs\x94}\x94\x8c\x07_result\x94N\x8c\x05"
    b"_done\x94\x89\x8c\x0c_timeout_min\x94K\x00\x8c\x12_timeout_countdown\x94K\x00ub."
)
# The bare reference (pickle protocol 4) the same version gives each function.
OLD_TASK_REFERENCE = (
    b"\x80\x04\x95$\x00\x00\x00\x00\x00\x00\x00\x8c\x11batchinfer.launch\x94\x8c\nslurm_task\x94\x93\x94."
)
OLD_MERGE_REFERENCE = (
    b"\x80\x04\x95%\x00\x00\x00\x00\x00\x00\x00\x8c\x11batchinfer.launch\x94\x8c\x0bslurm_merge\x94\x93\x94."
)

STABLE = {
    "slurm_task": (("DIR", [0]), OLD_TASK_SUBMISSION, OLD_TASK_REFERENCE),
    "slurm_merge": (("DIR",), OLD_MERGE_SUBMISSION, OLD_MERGE_REFERENCE),
}


@pytest.mark.parametrize("name", sorted(STABLE))
def test_submitit_pickles_the_job_function_by_reference(name: str, tmp_path: Path) -> None:
    fn = getattr(batchinfer.launch, name)
    assert fn.__module__ == "batchinfer.launch" and fn.__qualname__ == name
    args = STABLE[name][0]
    # As submitit writes a job: DelayedSubmission.dump is cloudpickle.dump(obj, f, HIGHEST_PROTOCOL).
    job = tmp_path / "submitted.pkl"
    DelayedSubmission(fn, *args).dump(job)
    data = job.read_bytes()
    assert data == cloudpickle.dumps(DelayedSubmission(fn, *args), pickle.HIGHEST_PROTOCOL)
    assert b"batchinfer.launch" in data and name.encode() in data
    # By reference: no code object, none of the names its body uses.
    for by_value in (b"_make_function", b"_builtin_type", b"CodeType", b"setup_logging", b"RunDir"):
        assert by_value not in data, by_value
    loaded = DelayedSubmission.load(job)  # what the Slurm task runs
    assert loaded.function is fn and loaded.args == args
    assert pickle.loads(cloudpickle.dumps(fn)) is fn


@pytest.mark.parametrize("name", sorted(STABLE))
def test_a_job_queued_before_the_restructure_runs_the_current_function(name: str, tmp_path: Path) -> None:
    fn = getattr(batchinfer.launch, name)
    args, submission, reference = STABLE[name]
    assert pickle.loads(reference) is fn
    assert cloudpickle.loads(reference) is fn
    job = tmp_path / "submitted.pkl"  # the job folder's file, written before the upgrade
    job.write_bytes(submission)
    loaded = DelayedSubmission.load(job)
    assert loaded.function is fn and loaded.args == args and loaded.kwargs == {}
    # The current version writes the same reference (protocol 4, as an old job holds it).
    assert pickle.dumps(fn, protocol=4) == reference


def _old_record() -> dict[str, Any]:
    record = yaml.safe_load(RUN_0_1_0.read_text())
    assert record["batchinfer"] == "0.1.0"
    return record


def test_run_yaml_of_0_1_0_reproduces_its_fingerprint() -> None:
    record = _old_record()
    keys = fingerprint_keys(record["config"], record["input"]["fingerprint"])
    assert keys == record["fingerprint_keys"]
    assert fingerprint(keys) == record["fingerprint"]
    # A changed output-relevant key changes the fingerprint (the comparison can fail).
    other = dict(record["config"], sampling=dict(record["config"]["sampling"], max_tokens=9))
    assert fingerprint(fingerprint_keys(other, record["input"]["fingerprint"])) != record["fingerprint"]


def test_run_yaml_of_0_1_0_loads_into_the_typed_config() -> None:
    record = _old_record()
    cfg = to_config(record["config"])
    assert isinstance(cfg, Config)
    assert cfg.model.path == record["config"]["model"]["path"] == "/tmp/bi-0.1.0/model"
    assert cfg.prompt.labels.names == record["config"]["prompt"]["labels"]["names"] == ["physics", "biology", "other"]
    assert cfg.output.format == record["config"]["output"]["format"] == "jsonl"
    assert cfg.cluster.max_attempts == record["config"]["cluster"]["max_attempts"] == 5
    assert cfg.sharding.num_shards == 2 and cfg.sampling.max_tokens == 8


def test_run_dir_of_0_1_0_opens(tmp_path: Path) -> None:
    shutil.copy(RUN_0_1_0, tmp_path / "run.yaml")
    run = RunDir(tmp_path)
    assert run.exists() and run.run == _old_record()
    assert isinstance(run.config, Config) and run.config.cluster.max_attempts == 5
    assert run.output_format == "jsonl" and run.output_split is None
    assert run.schema.names == list(_old_record()["output_schema"]["columns"])
