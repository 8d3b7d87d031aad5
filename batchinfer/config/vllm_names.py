"""The names vLLM accepts for model.dtype, quantization.method, quantization.kv_cache_dtype and
model.reasoning_parser, and its logprobs cap: known on the login node without importing vllm,
so a misspelt name is refused before a job waits in the queue to fail at engine start.

Data only (no imports): scripts/vllm_contract.py loads this file by its path and compares each
table with the installed vLLM's own list (tests/contract/test_vllm_contract.py runs it). When a
vLLM release adds or drops a name, that check fails: update the table here."""

# vllm.config.model.ModelDType
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")

# vllm.model_executor.layers.quantization.QUANTIZATION_METHODS
QUANTIZATION_METHODS = (
    "awq",
    "auto_awq",
    "fp8",
    "fbgemm_fp8",
    "fp_quant",
    "modelopt",
    "modelopt_fp4",
    "modelopt_mxfp8",
    "modelopt_mixed",
    "auto_gptq",
    "gptq",
    "gptq_marlin",
    "awq_marlin",
    "humming",
    "compressed-tensors",
    "experts_int8",
    "quark",
    "moe_wna16",
    "torchao",
    "inc",
    "mxfp4",
    "gpt_oss_mxfp4",
    "deepseek_v4_fp8",
    "online",
    "fp8_per_tensor",
    "fp8_per_block",
    "fp8_per_channel",
    "int8_per_channel_weight_only",
    "nvfp4_per_token",
    "mxfp8",
)

# vllm.config.cache.CacheDType
KV_CACHE_DTYPES = (
    "auto",
    "float16",
    "bfloat16",
    "fp8",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_ds_mla",
    "nvfp4_ds_mla",
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
    "ultraquant_4bit",
    "int4_per_token_head",
    "int8_per_token_head",
    "fp8_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
)

# vllm.reasoning.ReasoningParserManager.list_registered()
REASONING_PARSERS = (
    "cohere_command3",
    "cohere_command4",
    "deepseek_r1",
    "deepseek_v3",
    "deepseek_v4",
    "deepseek_v41",
    "ernie45",
    "gemma4",
    "glm45",
    "glm47",
    "granite",
    "granite_thinking_parser",
    "hf",
    "holo2",
    "hunyuan_a13b",
    "hy_v3",
    "hy_v4",
    "inkling",
    "k2_horizon",
    "kimi_k2",
    "kimi_k3",
    "ling3",
    "mimo",
    "minicpmv",
    "minimax_m2",
    "minimax_m2_append_think",
    "minimax_m3",
    "mistral",
    "muse_glimmer",
    "nemotron_v3",
    "olmo3",
    "openai_gptoss",
    "plamo3",
    "poolside_v1",
    "qwen3",
    "seed_oss",
    "step3",
    "step3p5",
)

# vllm.config.model.ModelConfig.max_logprobs: the default cap on sampling.logprobs (-1: no cap);
# model.engine_kwargs.max_logprobs changes it.
MAX_LOGPROBS = 20
