"""The fast stand-in engine for tests that need the worker, not vLLM, and run directories for it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from batchinfer.config.compose import compose
from batchinfer.config.vllm_names import MAX_LOGPROBS
from batchinfer.engine.vllm_engine import Completion
from batchinfer.rundir.prepare import prepare
from batchinfer.rundir.store import RunDir
from support.corpus import write_corpus
from support.runs import fake_model_dir
from support.standin import check_logprobs, checked_params, digest, vllm_refusal


class FakeEngine:
    """The unit tests' engine: answers each request from its own token ids (`answer`), so a row
    given another row's result is caught, and finishes `per_step` requests per step, chosen by
    digest and step number rather than in the order they came. It refuses (vLLM's own
    VLLMValidationError at add, as vLLM refuses a request) the prompts `refuse` names, and sampling
    values where vLLM refuses them, and dies (its next step raises, as a dead
    engine core does) once a prompt `poison` names is added; prompts are texts of one message."""

    max_model_len = 1000
    max_num_seqs = 4
    startup_seconds = 0.0
    device = "fake device"
    max_loras: Optional[int] = None  # LoRA adapter slots (a LoRA engine's; vllm_engine.Engine.max_loras)

    def __init__(self, per_step: int = 3, refuse: Iterable[str] = (), poison: Iterable[str] = ()):
        self.per_step = per_step
        self.queue: list[tuple[str, list[int]]] = []
        self.adapters: dict[str, str] = {}  # request id -> its LoRA adapter (none: the base model)
        self.images: dict[str, str] = {}  # request id -> its image's content digest (none: no image)
        self.sizes: list[tuple[int, int]] = []  # the sizes of the decoded images it was given, in the order added
        self.added: list[list[int]] = []
        self.steps = 0
        self.refused = {tuple(self.ids(t)) for t in refuse}
        self.poisoned = {tuple(self.ids(t)) for t in poison}
        self.in_flight: list[int] = []  # requests queued at each step
        self.sent_adapters: list[Optional[str]] = []  # the adapter of each request added, in order (None: base model)
        self.loras_in_flight: list[set[str]] = []  # the adapters of the requests queued at each step
        self.died_with: list[list[int]] | None = None  # the requests queued when it died
        self.aborted: list[list[int]] = []  # requests dropped by abort_all
        self.lora_slots: list[str] = []  # adapters in its max_loras slots, least recently used first
        self.loads = 0  # adapters moved into a slot (vLLM's LRUCacheLoRAModelManager.activate_adapter)

    def ids(self, text: str) -> list[int]:
        """Token ids of a prompt of one message (the default chat prompt of a row's text)."""
        return self.encode([{"content": text}])

    @staticmethod
    def answer(ids: list[int], adapter: Optional[str] = None, image: Optional[str] = None) -> str:
        """What this engine answers a request of these token ids (under a LoRA adapter: its name
        mixed in; with an image: its digest mixed in)."""
        mixed = ids if adapter is None else [*ids, -1, *adapter.encode()]
        mixed = mixed if image is None else [*mixed, -2, *image.encode()]
        return f"ans-{digest(mixed) % 16**8:08x}"

    def sampling_params(self, sampling: dict[str, Any]) -> Any:
        return checked_params(sampling)

    def encode(self, prompt: Any, chat_template_kwargs: Any = None) -> list[int]:
        text = prompt if isinstance(prompt, str) else " ".join(_text(m["content"]) for m in prompt)
        return [ord(c) % 50 for c in text]

    def add(
        self, request_id: str, token_ids: list[int], params: Any, adapter: Optional[str] = None, image: Any = None
    ) -> None:
        if adapter is not None:
            self.adapters[request_id] = adapter
        if image is not None:  # (content digest, decoded PIL image), as the real engine takes it
            self.images[request_id] = image[0]
            self.sizes.append(image[1].size)  # not the image: vLLM keeps its processed tensors, not the picture
        if tuple(token_ids) in self.refused:
            raise vllm_refusal(f"the fake engine refuses this request ({len(token_ids)} tokens)")
        check_logprobs(params, MAX_LOGPROBS)
        self.queue.append((request_id, token_ids))
        self.added.append(token_ids)
        self.sent_adapters.append(adapter)
        if adapter is not None and self.max_loras:
            self._activate(adapter)

    def _activate(self, adapter: str) -> None:
        """An adapter into a slot, as vLLM's LRU of max_loras slots does: a load unless it is there."""
        if adapter in self.lora_slots:
            self.lora_slots.remove(adapter)
        else:
            self.loads += 1
            if len(self.lora_slots) == self.max_loras:
                self.lora_slots.pop(0)
        self.lora_slots.append(adapter)

    def lora_loads(self) -> int:
        """Adapters moved into a slot so far (vllm_engine.Engine.lora_loads)."""
        return self.loads

    def step(self) -> list[Completion]:
        if any(tuple(ids) in self.poisoned for _, ids in self.queue):
            self.died_with = [ids for _, ids in self.queue]
            raise RuntimeError("vLLM engine core died")  # what the real engine's watchdog raises
        self.steps += 1
        self.in_flight.append(len(self.queue))
        self.loras_in_flight.append({self.adapters[rid] for rid, _ in self.queue if rid in self.adapters})
        ready = sorted(self.queue, key=lambda q: (digest(q[1]) + self.steps) % 7)[: self.per_step]
        self.queue = [q for q in self.queue if q not in ready]
        return [
            Completion(rid, [self.answer(ids, self.adapters.get(rid), self.images.get(rid))], "stop", len(ids), 1)
            for rid, ids in ready
        ]

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def abort_all(self) -> None:
        self.aborted += [ids for _, ids in self.queue]
        self.queue = []


def _text(content: Any) -> str:
    """A message's text: its content, or its parts' texts with an image part as <image>."""
    if isinstance(content, str):
        return content
    return "".join("<image>" if p["type"] == "image" else p.get("text", "") for p in content)


def fake_overrides(tmp_path: Path, corpus: Path, *extra: str) -> list[str]:
    """A run of corpus into tmp_path/run on a fake model folder (no engine starts)."""
    return [f"input.path={corpus}", f"model.path={fake_model_dir(tmp_path)}", f"output.dir={tmp_path}/run", *extra]


def prepared(tmp_path: Path, n: int = 12, *extra: str) -> RunDir:
    """A prepared run directory of n random rows on a fake model folder."""
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, n)
    return prepare(compose(fake_overrides(tmp_path, corpus, "input.id_column=id", *extra)))


def keyed(eng: FakeEngine, run: RunDir) -> FakeEngine:
    """The fake engine, keyed to run's model config (as the engine a run checks it was given)."""
    from batchinfer.engine.engine_args import model_key

    eng.key = model_key(run.config)  # type: ignore[attr-defined]
    return eng
