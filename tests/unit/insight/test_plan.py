"""`batchinfer plan`: login-node token counts, weights and KV sizing, layout advice; no engine, no torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import REPO
from support.corpus import write_corpus
from support.model_configs import LLAMA_8B, LLAMA_70B
from support.procs import run_cli

from batchinfer.errors import ConfigError
from batchinfer.inputs.preview import peek, spread
from batchinfer.models import advice, sizing
from batchinfer.models.tokens import LoginTokenizer

SMOLLM2_PARAMS = 134_515_008  # the tensors' elements in its model.safetensors (embeddings tied)
MINILM_PARAMS = 22_713_216  # all-MiniLM-L6-v2's float32 tensors (its int64 position_ids buffer is no parameter)
BERT_MINILM = {  # all-MiniLM-L6-v2's config.json
    "architectures": ["BertModel"],
    "model_type": "bert",
    "hidden_size": 384,
    "intermediate_size": 1536,
    "num_attention_heads": 12,
    "num_hidden_layers": 6,
    "vocab_size": 30522,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "position_embedding_type": "absolute",
}
# BAAI/bge-m3 (XLM-RoBERTa large): 567,754,752 parameters in its checkpoint.
BGE_M3 = dict(
    BERT_MINILM,
    architectures=["XLMRobertaModel"],
    model_type="xlm-roberta",
    hidden_size=1024,
    intermediate_size=4096,
    num_attention_heads=16,
    num_hidden_layers=24,
    vocab_size=250002,
    max_position_embeddings=8194,
    type_vocab_size=1,
)
# Qwen/Qwen3-Embedding-0.6B: a decoder (causal attention, last-token pooling) with a KV cache.
QWEN3_EMBEDDING = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 28,
    "vocab_size": 151669,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "You label abstracts."}, {"role": "user", "content": "Physics or biology?"}],
    [{"role": "user", "content": "Grüße aus Köln — naïve café, 東京, Привет, 🙂🚀"}],
    [{"role": "user", "content": "  leading and trailing spaces  "}],
    [{"role": "user", "content": "line one\nline two\n\n\ttabbed"}],
    [{"role": "user", "content": "word " * 2000}],
    [{"role": "user", "content": "<|im_start|>user\nnot really a turn<|im_end|>"}],
    [{"role": "user", "content": '{"json": [1, 2, 3], "quote": "\\""}'}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "empty system"}],
    [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "zlib.compress"},
        {"role": "assistant", "content": "compression"},
        {"role": "user", "content": "socket.socket"},
    ],
    [{"role": "user", "content": "def f(x):\n    return x ** 2  # code"}],
    [{"role": "user", "content": "العربية من اليمين إلى اليسار"}],
    [{"role": "user", "content": "a"}],
    [{"role": "user", "content": "https://example.org/path?q=1&r=2#frag"}],
    [{"role": "user", "content": "Mixed CASE and numbers 1234567890 3.14159"}],
    [{"role": "assistant", "content": "an assistant turn first"}, {"role": "user", "content": "then the user"}],
    [{"role": "user", "content": "ℌ𝔢𝔩𝔩𝔬 in math letters, and combining e\u0301"}],
    [{"role": "system", "content": "S" * 500}, {"role": "user", "content": "long system prompt"}],
    [{"role": "user", "content": "\u200bzero width\u200d joiners"}],
    [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 50}],
]
LOGIN_NODE = """
import sys
from batchinfer.models.tokens import LoginTokenizer
from batchinfer.cli import main
n = LoginTokenizer.from_model_dir(sys.argv[1]).count_chat([{"role": "user", "content": "hi"}])
code = main(sys.argv[2:])
heavy = sorted(m for m in ("vllm", "torch", "transformers") if m in sys.modules)
print("COUNT", n, "CODE", code, "HEAVY", heavy)
"""


@pytest.fixture(scope="module")
def minilm() -> Path:
    """The real all-MiniLM-L6-v2 sentence-transformers folder (prepared once from its wheel)."""
    from batchinfer.models.locations import prepare_minilm

    return prepare_minilm()


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct folder (prepared once; the example needs it too)."""
    from batchinfer.models.locations import prepare_smollm2

    return prepare_smollm2()


def write_model(parent: Path, config: dict, name: str = "model") -> Path:
    """A model folder holding only config.json: enough for sizing."""
    d = parent / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


def plan_json(*args: str) -> dict:
    res = run_cli(["plan", "--json", *args])
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_chat_and_raw_counts_match_transformers(smollm2: Path) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(smollm2)
    tok = LoginTokenizer.from_model_dir(smollm2)
    for messages in CONVERSATIONS:
        text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.render(messages) == text
        assert tok.count_chat(messages) == len(ref.encode(text, add_special_tokens=False))
        raw = messages[-1]["content"]
        assert tok.count_raw(raw) == len(ref.encode(raw))


def test_raw_count_ignores_add_bos_token_like_transformers(smollm2: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = tmp_path / "bos"
    folder.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(smollm2 / name, folder / name)
    config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(config, add_bos_token=True)))
    ref = AutoTokenizer.from_pretrained(folder)
    tok = LoginTokenizer.from_model_dir(folder)
    for text in ("hello world", "Grüße 東京"):
        # transformers 5 drops add_bos_token when a tokenizer.json exists: its post-processor decides.
        assert tok.count_raw(text) == len(ref.encode(text)) == len(ref.encode(text, add_special_tokens=False))


def test_template_from_tokenizer_config_and_generation_tag(smollm2: Path, tmp_path: Path) -> None:
    folder = tmp_path / "tc"
    folder.mkdir()
    shutil.copy(smollm2 / "tokenizer.json", folder / "tokenizer.json")
    template = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] | tojson }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ strftime_now('%Y') | length }}{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"bos_token": {"content": "<|im_start|>"}, "chat_template": [{"name": "default", "template": template}]}
        )
    )
    tok = LoginTokenizer.from_model_dir(folder)
    msgs = [{"role": "user", "content": "a<b"}, {"role": "assistant", "content": "é"}]
    assert tok.render(msgs) == '<|im_start|>a<b"é"4'  # tojson keeps <, > and non-ASCII as they are
    bad = "{{ raise_exception('no system role') }}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": bad}))
    with pytest.raises(Exception, match="no system role"):
        LoginTokenizer.from_model_dir(folder).render(msgs)


def test_plan_on_smollm2_and_a_jsonl(smollm2: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 50)
    ov = [f"input.path={corpus}", f"model.path={smollm2}", "sharding.num_shards=3", "sampling.max_tokens=16"]
    env = dict(os.environ, PYTHONPATH=str(REPO))  # run from tmp_path, to see that no runs/ folder appears
    res = subprocess.run(
        [sys.executable, "-c", LOGIN_NODE, str(smollm2), "plan", *ov],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    out = " ".join(res.stdout.split())  # long lines wrap
    assert f"input {corpus} (jsonl): 50 rows" in out
    assert "shards 3 shards of up to 17 rows; 3 array tasks at cluster.shards_per_task=1" in out
    assert "134.5M parameters (safetensors headers)" in out and "22.5 KiB per token" in out
    assert "chat mode, 50 of 50 rows tokenized" in out and "output <= 800 (rows x max_tokens 16 x n 1)" in out
    assert "run one model copy per GPU" in out and "CODE 0 HEAVY []" in out
    assert not (tmp_path / "runs").exists()  # plan creates no run directory

    report = plan_json(*ov)
    assert set(report) == {"input", "prompt_tokens", "model", "gpus", "engines", "notes"}
    assert report["engines"]["engines_per_task"] == 1 and "engines " not in out  # one engine: no line
    assert report["input"] | {"path": None} == {
        "path": None,
        "files": 1,
        "format": "jsonl",
        "rows": 50,
        "shards": 3,
        "max_rows_per_shard": 17,
        "shards_per_task": 1,
        "array_tasks": 3,
    }
    m = report["model"]
    assert m["params"] == SMOLLM2_PARAMS == sizing.config_params(json.loads((smollm2 / "config.json").read_text()))
    assert m["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23040
    assert m["weight_bytes"] == 2 * SMOLLM2_PARAMS and m["max_model_len"] == 2048
    ref = AutoTokenizer.from_pretrained(smollm2)
    counts = [
        len(
            ref.encode(
                ref.apply_chat_template(
                    [{"role": "user", "content": r["text"]}], tokenize=False, add_generation_prompt=True
                ),
                add_special_tokens=False,
            )
        )
        for r in rows
    ]
    pt = report["prompt_tokens"]
    assert pt["estimated_total"] == sum(counts) and pt["max"] == max(counts) and pt["row_errors"] == 0
    assert pt["output_upper_bound"] == 800
    (gpu,) = report["gpus"]
    assert gpu["gpu"] == "H100-80GB" and gpu["recommended_tp"] == 1 and gpu["warnings"] == []
    assert gpu["kv_tokens"] == (72 * 10**9 - 2 * SMOLLM2_PARAMS) // 23040
    assert {
        "usable_bytes",
        "weight_bytes_per_gpu",
        "kv_cache_bytes_per_gpu",
        "max_seqs_at_max_model_len",
        "seqs_at_corpus_length",
        "layout",
    } <= set(gpu)


def test_llama_3_3_70b_walkthrough(tmp_path: Path) -> None:
    folder = write_model(tmp_path, LLAMA_70B)
    model = sizing.read_model(folder)
    assert 70.5e9 < model.params < 70.7e9 and model.params_source == "config.json"
    per_token = sizing.kv_bytes_per_token(model, 2)
    assert per_token == 320 * 1024  # 2 x 80 layers x 8 KV heads x 128 x 2 bytes
    assert per_token * 8192 == 2.5 * sizing.GIB and per_token * 131072 == 40 * sizing.GIB
    # FP8 weights on one H200 at gpu_memory_utilization 0.92: 141 GB x 0.92 = 129.7 GB - 70.6 GB.
    report = plan_json(f"model.path={folder}", "quantization=fp8", "model.gpu_memory_utilization=0.92", "--gpu", "h200")
    assert report["model"]["weight_bytes_per_param"] == 1 and report["model"]["kv_bytes_per_token"] == 327_680
    (gpu,) = report["gpus"]
    assert gpu["gpu"] == "H200-141GB" and gpu["usable_bytes"] == pytest.approx(129.7e9, rel=1e-3)
    assert gpu["kv_cache_bytes_per_gpu"] == pytest.approx(59e9, rel=0.01)
    assert gpu["kv_tokens"] == pytest.approx(180_000, rel=0.01)
    assert report["notes"] == ["input.path is not set: sizing only"]
    kv8 = plan_json(f"model.path={folder}", "quantization=kv-fp8")["model"]
    assert kv8["kv_bytes_per_token"] == 160 * 1024 and kv8["weight_bytes_per_param"] == 2


def test_layout_advice_one_copy_per_gpu_or_smallest_tp(tmp_path: Path) -> None:
    small = sizing.read_model(write_model(tmp_path, LLAMA_8B, "8b"))
    adv = advice.advice(small, sizing.weight_bytes(small, None, "bfloat16"), 2, "H100-80GB", 0.9, 1, 8192)
    assert adv["recommended_tp"] == 1 and adv["warnings"] == []
    assert "one model copy per GPU" in adv["layout"] and "1.9x to 5.2x" in adv["layout"]
    big = sizing.read_model(write_model(tmp_path, LLAMA_70B, "70b"))
    wbytes = sizing.weight_bytes(big, None, "bfloat16")
    assert sizing.fit(big, wbytes, 2, "H100-80GB", 0.9, 2, 8192).max_seqs < sizing.MIN_SEQS  # ~1 sequence
    adv = advice.advice(big, wbytes, 2, "H100-80GB", 0.9, 1, 8192)
    assert adv["recommended_tp"] == 4 and "model.tensor_parallel_size=4 cluster.gpus_per_task=4" in adv["layout"]
    assert "leave no room for a KV cache" in adv["warnings"][0]
    res = run_cli(["plan", f"model.path={tmp_path / '70b'}", "model.max_model_len=8192", "--gpu", "all"])
    assert res.returncode == 0, res.stderr
    table = {line.split()[0]: line.split()[-1] for line in res.stdout.splitlines() if line.startswith("  ")}
    assert table["H100-80GB"] == "4" and table["A100-40GB"] == "8" and table["H200-141GB"] == "2"


def test_single_digit_concurrency_warning_names_the_levers(tmp_path: Path) -> None:
    big = sizing.read_model(write_model(tmp_path, LLAMA_70B, "70b"))
    adv = advice.advice(big, sizing.weight_bytes(big, None, "bfloat16"), 2, "A100-40GB", 0.9, 4, 8192)
    (warning,) = adv["warnings"]
    assert "holds only 1.1 sequences of max_model_len=8,192" in warning
    assert "quantization=kv-fp8" in warning and "model.tensor_parallel_size=8" in warning
    assert "lower model.max_model_len" in warning
    report = plan_json(
        f"model.path={tmp_path / '70b'}", "model.max_model_len=131072", "quantization=fp8", "--gpu", "h200"
    )
    (warning,) = report["gpus"][0]["warnings"]
    assert "holds only 1.3 sequences of max_model_len=131,072" in warning and "tensor parallel 2" in warning


def test_pre_quantized_checkpoints(tmp_path: Path) -> None:
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128}
    model = sizing.read_model(write_model(tmp_path, dict(LLAMA_8B, quantization_config=awq), "awq"))
    assert model.quant_method == "awq" and sizing.weight_bytes_per_param(model, None, "auto") == 0.5
    ct = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 8}}}}
    model = sizing.read_model(write_model(tmp_path, dict(LLAMA_8B, quantization_config=ct), "ct"))
    assert sizing.weight_bytes_per_param(model, "fp8", "auto") == 1
    report = plan_json(f"model.path={tmp_path / 'awq'}", "quantization=fp8")
    assert report["model"]["quantization"] == "awq" and report["model"]["checkpoint_quantized"]
    assert "quantization.method=fp8 is not used for sizing" in report["notes"][0]


def test_plan_errors_name_the_problem(tmp_path: Path) -> None:
    res = run_cli(["plan", f"model.path={tmp_path}/nope"])
    assert res.returncode == 2 and f"model.path {tmp_path}/nope: no model folder with a config.json there" in res.stderr
    res = run_cli(["plan", "model.path=acme/not-downloaded"], env={"HF_HOME": str(tmp_path / "hf")})
    assert res.returncode == 2 and "model.path acme/not-downloaded: not in the local Hugging Face cache" in res.stderr
    assert "huggingface-cli download acme/not-downloaded config.json" in res.stderr
    folder = write_model(tmp_path, LLAMA_8B)
    res = run_cli(["plan", f"model.path={folder}", "--gpu", "a100"])
    assert res.returncode == 2 and "--gpu a100 is ambiguous" in res.stderr
    res = run_cli(["plan", f"model.path={folder}", f"input.path={tmp_path}/missing.jsonl"])
    assert res.returncode == 2 and "missing.jsonl: no such file" in res.stderr
    assert "Traceback" not in res.stderr
    with pytest.raises(ConfigError, match="not a GPU preset"):
        sizing.gpu_names("V100")


@pytest.mark.parametrize("fmt", ["parquet", "csv", "tsv", "json", "arrow", "openai"])
def test_peek_counts_and_samples_without_converting(tmp_path: Path, fmt: str) -> None:
    rows = [{"id": f"r{i}", "text": f"row {i}"} for i in range(7)]
    path = tmp_path / f"in.{'jsonl' if fmt == 'openai' else fmt}"
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt in ("csv", "tsv"):
        sep = "," if fmt == "csv" else "\t"
        path.write_text("id" + sep + "text\n" + "".join(f"{r['id']}{sep}{r['text']}\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "arrow":
        with pa.ipc.new_file(str(path), pa.Table.from_pylist(rows).schema) as w:
            w.write_table(pa.Table.from_pylist(rows))
    else:
        body = lambda r: {"messages": [{"role": "user", "content": r["text"]}]}  # noqa: E731
        path.write_text("\n\n".join(json.dumps({"custom_id": r["id"], "body": body(r)}) for r in rows))
    n, sample = peek([path], fmt, 3)
    assert n == 7 and len(sample) == 3
    if fmt == "openai":
        assert [s["messages"][0]["content"] for s in sample] == ["row 0", "row 2", "row 4"]
    else:
        assert [s["text"] for s in sample] == ["row 0", "row 2", "row 4"]
    assert spread(5, 10) == [0, 1, 2, 3, 4] and spread(10, 4) == [0, 2, 5, 7]


def test_bert_style_parameter_counts_and_no_kv_cache(tmp_path: Path) -> None:
    minilm = sizing.read_model(write_model(tmp_path, BERT_MINILM, "minilm"))
    assert minilm.params == MINILM_PARAMS and minilm.encoder_only and minilm.architecture == "BertModel"
    # embeddings (30522 + 512 + 2) x 384 + LayerNorm, 6 x (4 h^2 + 2 h x 1536 + 9 h + 1536), pooler h^2 + h
    assert minilm.params == 30_522 * 384 + 512 * 384 + 2 * 384 + 768 + 6 * 1_774_464 + 384 * 384 + 384
    cross = dict(BERT_MINILM, architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"})
    assert sizing.config_params(cross) == MINILM_PARAMS + 384 + 1  # cross-encoder/ms-marco-MiniLM-L-6-v2
    bge = sizing.read_model(write_model(tmp_path, BGE_M3, "bge"))
    assert bge.params == 567_754_752 and bge.encoder_only
    qwen = sizing.read_model(write_model(tmp_path, QWEN3_EMBEDDING, "qwen3-embedding"))
    assert qwen.params == 595_776_512 and not qwen.encoder_only
    bidirectional = sizing.read_model(write_model(tmp_path, dict(LLAMA_8B, is_causal=False), "bidi"))
    assert bidirectional.encoder_only and bidirectional.params == sizing.config_params(LLAMA_8B)  # Llama-style
    assert not sizing.read_model(write_model(tmp_path, LLAMA_8B, "8b")).encoder_only
    # an encoder's batch is bounded by activations: (4 h + 2 intermediate) x bytes per token
    assert sizing.activation_bytes_per_token(minilm, 4) == (4 * 384 + 2 * 1536) * 4 == 18_432
    assert sizing.token_bytes(bge, 2) == (4 * 1024 + 2 * 4096) * 2
    assert sizing.token_bytes(qwen, 2) == sizing.kv_bytes_per_token(qwen, 2) == 2 * 28 * 8 * 128 * 2

    report = plan_json(f"model.path={tmp_path / 'bge'}", "task=embed", "model.dtype=float16", "--gpu", "l40s")
    m = report["model"]
    assert m["kv_cache"] is False and m["kv_bytes_per_token"] == 0 and m["kv_bytes_per_sequence"] == 0
    assert m["activation_bytes_per_token"] == 24_576 and m["weight_bytes"] == 2 * 567_754_752
    (gpu,) = report["gpus"]
    assert gpu["kv_tokens"] == 0 and gpu["kv_cache_bytes_per_gpu"] == 0
    assert gpu["activation_bytes_per_gpu"] == int(48e9 * 0.9) - 2 * 567_754_752
    assert gpu["batch_tokens_fit"] == gpu["activation_bytes_per_gpu"] // 24_576
    assert gpu["max_num_batched_tokens"] == 8192 and gpu["recommended_tp"] == 1

    res = run_cli(["plan", f"model.path={tmp_path / 'qwen3-embedding'}", "task=embed"])
    assert res.returncode == 0, res.stderr
    out = " ".join(res.stdout.split())
    assert "kv 2 (K, V) x 28 layers x 8 KV heads x head_dim 128 x 2 bytes" in out and "encoder-only" not in out
    assert "112.0 KiB per token" in out and "GB for the KV cache" in out


def test_plan_of_the_real_minilm_for_embed(minilm: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    config = json.loads((minilm / "config.json").read_text())
    model = sizing.read_model(minilm)
    # the checkpoint's float32 tensors (90.9 MB on disk) agree with the count from config.json
    assert model.params_source == "safetensors headers" and model.params == MINILM_PARAMS
    assert sizing.config_params(config) == MINILM_PARAMS and model.stored_bytes == 4 * MINILM_PARAMS + 8 * 512
    corpus = tmp_path / "c.jsonl"
    rows = write_corpus(corpus, 40, min_words=3, max_words=60)
    rows[7]["text"] = " ".join(["archive"] * 400)  # over the 256-token window: cut by truncate_right
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ov = ["model=all-minilm-l6-v2", f"model.path={minilm}", "task=embed", f"input.path={corpus}"]
    report = plan_json(*ov)
    m, pt, (gpu,) = report["model"], report["prompt_tokens"], report["gpus"]
    assert m["weight_bytes_per_param"] == 4 and m["weight_bytes"] == 4 * MINILM_PARAMS  # the preset's float32
    assert m["kv_cache"] is False and m["activation_bytes_per_token"] == 18_432 and m["architecture"] == "BertModel"
    # counted as vLLM gets them from transformers: [CLS] text [SEP], no padding to tokenizer.json's 128
    ref = AutoTokenizer.from_pretrained(minilm)
    counts = [len(ref(r["text"])["input_ids"]) for r in rows]
    assert pt["estimated_total"] == sum(counts) and pt["max"] == max(counts) == 402
    assert pt["at_or_over_max_model_len"] == 1 and pt["output_upper_bound"] == 0 and pt["task"] == "embed"
    assert gpu["batch_tokens_fit"] == (72 * 10**9 - 4 * MINILM_PARAMS) // 18_432 and gpu["kv_tokens"] == 0
    assert gpu["max_num_batched_tokens"] == 16384 and gpu["warnings"] == []
    res = run_cli(["plan", *ov])
    assert res.returncode == 0, res.stderr
    out = " ".join(res.stdout.split())
    assert "22.7M parameters (safetensors headers), encoder-only (BertModel)" in out
    assert "weights 4 bytes per parameter (quantization none) = 0.09 GB" in out
    assert "kv none: vLLM runs an encoder-only model" in out and "KV heads" not in out
    assert "act (4 x hidden 384 + 2 x intermediate 1,536) x 4 bytes = 18.0 KiB per token" in out
    assert f"= {gpu['batch_tokens_fit']:,} tokens per batch" in out and "memory does not limit the batch" in out
    assert "nothing generated (task=embed: one embedding per row)" in out
    assert "1 sampled prompts exceed max_model_len=256" in out


def test_plan_of_score_counts_both_texts_and_names_their_key(minilm: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    pairs = [("what is a fox", "A fox is an animal."), ("capital of France", "Paris is in France, on the Seine.")]
    corpus = tmp_path / "pairs.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "q": q, "d": d}) + "\n" for i, (q, d) in enumerate(pairs)))
    ov = ["model=all-minilm-l6-v2", f"model.path={minilm}", "task=score", f"input.path={corpus}"]
    pt = plan_json(*ov, "task.query={q}", "task.document={d}")["prompt_tokens"]
    ref = AutoTokenizer.from_pretrained(minilm)
    # a bi-encoder embeds each text apart, each with [CLS] ... [SEP]
    assert pt["estimated_total"] == sum(len(ref(q)["input_ids"]) + len(ref(d)["input_ids"]) for q, d in pairs)
    res = run_cli(["plan", *ov, "task.query={q}", "task.document={passage}"])
    assert res.returncode == 2 and "task.document uses {passage} but" in res.stderr


def test_a_sequence_holds_whole_kv_blocks(tmp_path: Path) -> None:
    """A KV block larger than max_model_len holds one sequence: plan counts sequences per block, not
    per max_model_len (a 2^40-token block once "fitted" a million sequences of 128 tokens)."""
    folder = write_model(tmp_path, LLAMA_8B)
    short = ("--gpu", "h100", f"model.path={folder}", "model.max_model_len=128")
    (default,) = plan_json(*short)["gpus"]
    assert default["max_seqs_at_max_model_len"] == round(default["kv_tokens"] / 128, 2)  # 8 blocks of 16
    (big,) = plan_json(*short, "model.block_size=65536")["gpus"]
    assert big["kv_tokens"] == default["kv_tokens"]
    assert big["max_seqs_at_max_model_len"] == round(big["kv_tokens"] / 65536, 2) < 10
    assert big["warnings"][0].startswith("model.block_size=65,536 is larger than max_model_len=128: vLLM gives")
    (huge,) = plan_json(*short, f"model.block_size={2**40}")["gpus"]
    assert huge["max_seqs_at_max_model_len"] == 0
    assert sizing.kv_tokens_per_sequence(100, 32) == 128 and sizing.kv_tokens_per_sequence(128, 32) == 128
