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
from conftest import run_cli, write_corpus

from batchinfer.errors import ConfigError
from batchinfer.inputs.preview import peek, spread
from batchinfer.models import sizing
from batchinfer.models.tokens import LoginTokenizer

REPO = Path(__file__).resolve().parent.parent
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
SMOLLM2_PARAMS = 134_515_008  # the tensors' elements in its model.safetensors (embeddings tied)
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
    assert set(report) == {"input", "prompt_tokens", "model", "gpus", "notes"}
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
    adv = sizing.advice(small, sizing.weight_bytes(small, None, "bfloat16"), 2, "H100-80GB", 0.9, 1, 8192)
    assert adv["recommended_tp"] == 1 and adv["warnings"] == []
    assert "one model copy per GPU" in adv["layout"] and "1.9x to 5.2x" in adv["layout"]
    big = sizing.read_model(write_model(tmp_path, LLAMA_70B, "70b"))
    wbytes = sizing.weight_bytes(big, None, "bfloat16")
    assert sizing.fit(big, wbytes, 2, "H100-80GB", 0.9, 2, 8192).max_seqs < sizing.MIN_SEQS  # ~1 sequence
    adv = sizing.advice(big, wbytes, 2, "H100-80GB", 0.9, 1, 8192)
    assert adv["recommended_tp"] == 4 and "model.tensor_parallel_size=4 cluster.gpus_per_task=4" in adv["layout"]
    assert "leave no room for a KV cache" in adv["warnings"][0]
    res = run_cli(["plan", f"model.path={tmp_path / '70b'}", "model.max_model_len=8192", "--gpu", "all"])
    assert res.returncode == 0, res.stderr
    table = {line.split()[0]: line.split()[-1] for line in res.stdout.splitlines() if line.startswith("  ")}
    assert table["H100-80GB"] == "4" and table["A100-40GB"] == "8" and table["H200-141GB"] == "2"


def test_single_digit_concurrency_warning_names_the_levers(tmp_path: Path) -> None:
    big = sizing.read_model(write_model(tmp_path, LLAMA_70B, "70b"))
    adv = sizing.advice(big, sizing.weight_bytes(big, None, "bfloat16"), 2, "A100-40GB", 0.9, 4, 8192)
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
