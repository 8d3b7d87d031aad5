"""A finished shard's DONE.json: its progress record (progress.py), when it finished, what reproduces
its rows (Reproducibility), and the file its rows were compacted into (shard_folder.py seals it)."""

from __future__ import annotations

import socket
import sys
from dataclasses import asdict, dataclass
from typing import Any, Optional, TypedDict

from batchinfer.config.schema import Config
from batchinfer.rundir.progress import EngineSlot, Progress, ProgressRecord
from batchinfer.versions import installed_versions


class ModelUsed(TypedDict):
    """The model that answered: model.path, model.revision and the dtype the engine ran."""

    path: Optional[str]
    revision: Optional[str]
    dtype: str


class ReproducibilityRecord(TypedDict, total=False):
    """DONE.json's keys that reproduce its rows (Reproducibility.record)."""

    model: ModelUsed
    quantization: dict[str, Any]  # the config's sections as plain containers (QuantizationConfig, ...)
    sampling: dict[str, Any]
    prompt: dict[str, Any]
    host: str
    device: Optional[str]
    versions: dict[str, str]
    engine: EngineSlot  # absent: a single-engine run of before engine records


class DoneRecord(ProgressRecord, ReproducibilityRecord, total=False):
    """DONE.json: the shard's progress record, when it finished, what reproduces its rows, the
    compacted file (its name: absent from a shard sealed before compaction) and the later copies of
    rows dropped when sealing."""

    finished: float
    compacted: str
    duplicates_dropped: int


@dataclass(frozen=True)
class Reproducibility:
    """What a reader needs to reproduce a shard's rows: model, revision, settings, software, hardware."""

    model: ModelUsed
    cfg: Config
    host: str
    device: Optional[str]
    versions: dict[str, str]
    engine: Optional[EngineSlot] = None

    @classmethod
    def here(cls, cfg: Config, dtype: str, device: Optional[str], engine: Optional[EngineSlot]) -> Reproducibility:
        """This process's: the run's config, the engine's dtype and device, this host and software."""
        return cls(
            model=ModelUsed(path=cfg.model.path, revision=cfg.model.revision, dtype=dtype),
            cfg=cfg,
            host=socket.gethostname(),
            device=device,
            versions=dict(installed_versions(), python=sys.version.split()[0]),
            engine=engine,
        )

    def record(self) -> ReproducibilityRecord:
        """Its keys of DONE.json."""
        out = ReproducibilityRecord(
            model=self.model,
            quantization=asdict(self.cfg.quantization),
            sampling=asdict(self.cfg.sampling),
            prompt=asdict(self.cfg.prompt),
            host=self.host,
            device=self.device,
            versions=self.versions,
        )
        if self.engine:
            out["engine"] = self.engine
        return out


def done_record(progress: Progress, finished: float, reproducibility: Reproducibility) -> DoneRecord:
    """A shard's DONE.json before it is sealed (shard_folder.finish adds the compacted file)."""
    return {**progress.to_dict(), "finished": finished, **reproducibility.record()}  # type: ignore[typeddict-item]
