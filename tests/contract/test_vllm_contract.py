"""scripts/vllm_contract.py: the vLLM API vllm_engine.py uses, checked against the installed vllm
(no engine started), and the checker itself shown to fail on an API that lacks something."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from support import REPO

ROOT = REPO
SCRIPT = ROOT / "scripts" / "vllm_contract.py"


def _load() -> types.ModuleType:
    """The script as a module (importing it imports no vllm)."""
    spec = importlib.util.spec_from_file_location("vllm_contract", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_contract"] = module
    spec.loader.exec_module(module)
    return module


contract = _load()


def _check(name: str) -> Any:
    """The row of the contract table with this name."""
    return next(c for c in contract.CHECKS if c.name == name)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_installed_vllm_meets_the_contract() -> None:
    """Every check passes against the installed vllm and each one prints its own ok line."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, cwd=ROOT, check=False
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    lines = out.splitlines()
    assert lines[0].startswith("vllm "), out
    for check in contract.CHECKS:
        assert any(line.startswith(f"ok       {check.name}: ") for line in lines), (
            f"no ok line for {check.name}:\n{out}"
        )
    n = len(contract.CHECKS)
    assert f"{n} checks: {n} ok, 0 missing, 0 changed" in out


def test_check_names_are_unique_and_kinds_known() -> None:
    """Names identify lines in the output; a kind without a function would only fail at run time."""
    names = [c.name for c in contract.CHECKS]
    assert len(names) == len(set(names))
    assert {c.kind for c in contract.CHECKS} <= set(contract.KINDS)


def test_contract_lists_what_engine_passes(tmp_path: Path) -> None:
    """The LLM keywords, SamplingParams and StructuredOutputsParams fields in the table are
    exactly what batchinfer passes: a new config field or engine_kwargs preset fails here
    until the contract checks it too."""
    from batchinfer.config import schema as config
    from batchinfer.engine.vllm_engine import llm_kwargs, sampling_kwargs

    # Every optional model field set, so llm_kwargs passes all of them.
    model = {k: ("x" if v is None else v) for k, v in dataclasses.asdict(config.ModelConfig()).items()}
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')  # a LoRA adapter: enable_lora, max_loras, max_lora_rank
    model["lora"] = config.LoraConfig(adapters={"a": str(tmp_path)})
    for preset in (ROOT / "conf" / "speculative").glob("*.yaml"):
        model["engine_kwargs"].update(yaml.safe_load(preset.read_text()).get("engine_kwargs") or {})
    cfg = config.Config(model=config.ModelConfig(**model), quantization=config.QuantizationConfig(method="fp8"))
    assert set(llm_kwargs(cfg)) == set(contract.LLM_KWARGS)

    sampling = dataclasses.asdict(config.SamplingConfig(seed=1, logprobs=1))
    # Engine.sampling_params adds these two to what sampling_kwargs returns.
    assert set(sampling_kwargs(sampling)) | {"output_kind", "structured_outputs"} == set(contract.SAMPLING_FIELDS)
    so_fields = {f.name for f in dataclasses.fields(config.StructuredOutputsConfig)}
    assert so_fields == set(_check("StructuredOutputsParams fields").args)

    presets = {yaml.safe_load(p.read_text()).get("reasoning_parser") for p in (ROOT / "conf" / "model").glob("*.yaml")}
    checked = {c.args[0] for c in contract.CHECKS if c.kind == "reasoning_parser"}
    assert presets - {None} <= checked


def test_every_name_table_is_compared_with_vllm() -> None:
    """Each table of names config accepts without vllm (config/vllm_names.py, the one the script
    loads) has a `names` check, and the logprobs cap a default check; the presets use known names."""
    from batchinfer.config import vllm_names

    assert contract.NAMES.MODEL_DTYPES == vllm_names.MODEL_DTYPES  # the script reads batchinfer's file
    tables = {name for name in dir(vllm_names) if name.isupper() and isinstance(getattr(vllm_names, name), tuple)}
    assert {c.args[0] for c in contract.CHECKS if c.kind == "names"} == tables
    assert _check("max_logprobs default").args == ("max_logprobs", vllm_names.MAX_LOGPROBS)
    for preset in (ROOT / "conf" / "model").glob("*.yaml"):
        model = yaml.safe_load(preset.read_text())
        assert model.get("dtype", "auto") in vllm_names.MODEL_DTYPES, preset
        assert model.get("reasoning_parser") in (None, *vllm_names.REASONING_PARSERS), preset
    for preset in (ROOT / "conf" / "quantization").glob("*.yaml"):
        quant = yaml.safe_load(preset.read_text())
        assert quant.get("method") in (None, *vllm_names.QUANTIZATION_METHODS), preset
        assert quant.get("kv_cache_dtype", "auto") in vllm_names.KV_CACHE_DTYPES, preset


# A fake vLLM that lacks or changed what the contract asks for: each kind of check must fail on it.


@dataclasses.dataclass
class FakeResources:
    """Like BackgroundResources, without engine_dead."""

    alive: bool = True


@dataclasses.dataclass
class FakeStructuredConfig:
    """A backend Literal without xgrammar."""

    backend: Literal["auto", "guidance"] = "auto"


class FakeEngine:
    """Like LLMEngine, with add_request and abort_request changed and no renderer."""

    def __init__(self) -> None:
        self.vllm_config = None

    def add_request(self, request_id: str) -> None:
        """Takes no prompt or params."""

    def abort_request(self, request_ids: list[str], internal: bool = True) -> None:
        """Takes internal ids by default."""

    def get_output(self) -> Any:
        """Never raises what is queued."""
        return None


def fake_take(prompt: int | str) -> None:
    """Accepts ints and strings."""


def fake_give() -> int | bytes:
    """Returns bytes too."""
    return 0


class FakeParser:
    """extract_reasoning without the request argument."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def extract_reasoning(self, model_output: str) -> tuple[str, str]:
        """One argument only."""
        return "", model_output


class FakeParserManager:
    """Knows one parser, by another name than asked for."""

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type:
        """KeyError for anything but 'fake'."""
        if name != "fake":
            raise KeyError(name)
        return FakeParser


# A dtype list with one name more than batchinfer's table, and one with exactly its names.
FAKE_DTYPES = Literal["auto", "half", "float16", "bfloat16", "float", "float32", "float8"]
SAME_DTYPES = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]


def fake_parsers() -> list[str]:
    """Like ReasoningParserManager.list_registered, without one of the table's names."""
    return ["qwen3"]


class FakeLLM:
    """An LLM whose own keywords are model and seed, with no **kwargs."""

    def __init__(self, model: str, seed: int = 0) -> None:
        self.llm_engine = FakeEngine()


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> str:
    """A module 'fake_vllm' holding the fakes above."""
    module = types.ModuleType("fake_vllm")
    for obj in (FakeResources, FakeStructuredConfig, FakeEngine, FakeParserManager, FakeLLM, fake_take, fake_give):
        setattr(module, obj.__name__, obj)
    module.FAKE_DTYPES, module.SAME_DTYPES, module.fake_parsers = FAKE_DTYPES, SAME_DTYPES, fake_parsers
    monkeypatch.setitem(sys.modules, "fake_vllm", module)
    return "fake_vllm"


FAILING = [
    ("exists", "fake_vllm:FakeEngine.step", (), "MISSING", "no attribute 'step'"),
    ("exists", "no_such_vllm_module:LLM", (), "MISSING", "cannot import no_such_vllm_module"),
    ("fields", "fake_vllm:FakeResources", ("engine_dead",), "MISSING", "engine_dead (has: alive)"),
    ("fields", "fake_vllm:FakeEngine", ("vllm_config", "renderer"), "MISSING", "no attribute renderer"),
    ("llm_kwargs", "fake_vllm:FakeLLM", ("fake_vllm:FakeResources", ("model", "alive")), "MISSING", "alive"),
    ("accepts", "fake_vllm:FakeEngine.add_request", ("request_id", "prompt", "params"), "CHANGED", "cannot call"),
    ("sets_attr", "fake_vllm:FakeEngine", ("renderer",), "MISSING", "self.renderer"),
    ("source_has", "fake_vllm:FakeEngine.get_output", ("isinstance(outputs, Exception)",), "CHANGED", "no longer"),
    ("same", "fake_vllm:FakeEngine", ("fake_vllm:FakeLLM",), "CHANGED", "not fake_vllm:FakeLLM"),
    ("annotation_has", "fake_vllm:fake_take", ("prompt", "EngineInput"), "CHANGED", "does not name EngineInput"),
    ("annotation_covers", "fake_vllm:fake_take", ("prompt", "fake_vllm:fake_give", "return"), "CHANGED", "bytes"),
    ("param_default", "fake_vllm:FakeEngine.abort_request", ("internal", False), "CHANGED", "defaults to True"),
    ("literal_value", "fake_vllm:FakeStructuredConfig", ("backend", "xgrammar"), "CHANGED", "not 'xgrammar'"),
    ("reasoning_parser", "fake_vllm:FakeParserManager", ("qwen3",), "MISSING", "KeyError"),
    ("reasoning_parser", "fake_vllm:FakeParserManager", ("fake",), "CHANGED", "extract_reasoning cannot call"),
    ("names", "fake_vllm:FAKE_DTYPES", ("MODEL_DTYPES",), "CHANGED", "only in vLLM ['float8'], only in the table []"),
    ("names", "fake_vllm:fake_parsers", ("REASONING_PARSERS",), "CHANGED", "only in vLLM [], only in the table ["),
]


@pytest.mark.parametrize(("kind", "target", "args", "status", "detail"), FAILING)
def test_check_fails_on_a_changed_api(
    fake_vllm: str, kind: str, target: str, args: tuple, status: str, detail: str
) -> None:
    """Each kind of check reports what the fake vLLM lacks, with what it found."""
    result = contract.run_check(contract.Check("fake", kind, target, args))
    assert (result.status, detail in result.detail) == (status, True), result.detail


def test_every_kind_can_fail() -> None:
    """A kind with no failing case above would be a check that cannot fail."""
    assert {kind for kind, *_ in FAILING} == set(contract.KINDS)


PASSING = [
    ("fields", "fake_vllm:FakeResources", ("alive",)),
    ("fields", "fake_vllm:FakeEngine", ("vllm_config",)),
    ("accepts", "fake_vllm:FakeEngine.add_request", ("request_id",)),
    ("accepts", "fake_vllm:FakeParserManager.get_reasoning_parser", ("name",)),  # a classmethod: no self
    ("sets_attr", "fake_vllm:FakeLLM", ("llm_engine",)),
    ("llm_kwargs", "fake_vllm:FakeLLM", ("fake_vllm:FakeResources", ("model", "seed"))),
    ("annotation_covers", "fake_vllm:fake_take", ("prompt", "fake_vllm:fake_take", "prompt")),
    ("literal_value", "fake_vllm:FakeStructuredConfig", ("backend", "guidance")),
    ("names", "fake_vllm:SAME_DTYPES", ("MODEL_DTYPES",)),
]


@pytest.mark.parametrize(("kind", "target", "args"), PASSING)
def test_check_passes_on_a_matching_api(fake_vllm: str, kind: str, target: str, args: tuple) -> None:
    """The same checks pass where the fake has what is asked for."""
    result = contract.run_check(contract.Check("fake", kind, target, args))
    assert result.status == "ok", result.detail


def test_main_exit_code_and_lines(
    fake_vllm: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """main() prints a line per check, names what vllm_engine.py needs on a failure, exits 1 on any."""
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    good = contract.Check("has alive", "fields", "fake_vllm:FakeResources", ("alive",))
    bad = contract.Check("has engine_dead", "fields", "fake_vllm:FakeResources", ("engine_dead",), "watchdog")
    assert contract.main([], [good]) == 0
    assert contract.main([], [good, bad]) == 1
    out = capsys.readouterr().out
    assert "ok       has alive: " in out
    assert "MISSING  has engine_dead: no field engine_dead (has: alive)  [vllm_engine.py: watchdog]" in out
    assert "2 checks: 1 ok, 1 missing, 0 changed" in out
