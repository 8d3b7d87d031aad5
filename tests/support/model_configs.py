"""config.json of real models, for login-node sizing tests (no weights)."""

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LLAMA_8B = dict(LLAMA_70B, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32)
