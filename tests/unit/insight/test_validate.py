"""Bad input end to end, and `batchinfer validate`: the same prompts, errors and token counts as a run."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from support import REPO
from support.corpus import BAD_ROWS, write_corpus, write_rows
from support.procs import run_cli
from support.runs import fake_model_dir, model_overrides
from support.runs import run_overrides as overrides

from batchinfer.config.compose import compose
from batchinfer.errors import ConfigError, InputError
from batchinfer.inputs.convert import convert_input
from batchinfer.inputs.formats import detect_format
from batchinfer.insight import validate as validate_module
from batchinfer.insight.cpus import allowed_cpus, cgroup_cpu_limit
from batchinfer.insight.findings import Checked
from batchinfer.insight.row_check import check_rows
from batchinfer.insight.sample import Sample
from batchinfer.insight.token_stats import histogram, percentile
from batchinfer.insight.validate import validate
from batchinfer.models.maxlen import derived_max_model_len

LOGIN_NODE = """
import sys
from batchinfer.cli import main
code = main(sys.argv[1:])
heavy = sorted(m for m in ("vllm", "torch", "transformers") if m in sys.modules)
print("CODE", code, "HEAVY", heavy)
"""


def converted(tmp_path: Path, name: str, data: bytes) -> list[dict]:
    path = tmp_path / name
    path.write_bytes(data)
    convert_input([path], detect_format([path], None), tmp_path / "input", None, None)
    import datasets

    return datasets.load_from_disk(str(tmp_path / "input")).to_list()


# ---------------------------------------------------------------- file level, no engine


def test_histogram_keeps_outliers_in_one_last_bin_and_max_len_follows_vllm(tmp_path: Path) -> None:
    counts = Counter(range(1, 101)) + Counter({5000: 1})
    bins = histogram(counts)
    assert len(bins) == 10 and bins[-1] == {"from": 101, "to": 5000, "rows": 1}
    assert bins[0] == {"from": 1, "to": 12, "rows": 12} and sum(b["rows"] for b in bins) == 101
    assert percentile(counts, 0.5) == 51 and histogram(Counter({7: 3})) == [{"from": 7, "to": 7, "rows": 3}]
    model = tmp_path / "m"
    model.mkdir()
    rope = {"rope_type": "linear", "factor": 2.0}
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "rope_scaling": rope}))
    assert derived_max_model_len(model) == (8192, "config.json max_position_embeddings x RoPE factor 2")
    (model / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    # vLLM reads the tokenizer's model_max_length only for (pooling) models with absolute positions.
    assert derived_max_model_len(model) == (8192, "config.json max_position_embeddings x RoPE factor 2")
    config = {"max_position_embeddings": 4096, "rope_scaling": rope, "position_embedding_type": "absolute"}
    (model / "config.json").write_text(json.dumps(config))
    assert derived_max_model_len(model) == (
        2048,
        "tokenizer_config.json model_max_length x RoPE factor 2",
    )


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("empty.jsonl", b"", "{p}: no rows (the file is empty); there is nothing to run"),
        ("blank.jsonl", b"  \n\n\t\r\n", "{p}: no rows (only blank lines); there is nothing to run"),
        (
            "latin1.csv",
            b"id,text\na,x\nb,caf\xe9\n",
            "{p}:3: invalid UTF-8 at byte 5 of the line, file offset 17; re-encode the file as UTF-8",
        ),
    ],
)
def test_file_level_problems_name_the_file_and_line(tmp_path: Path, name: str, data: bytes, message: str) -> None:
    with pytest.raises(InputError) as e:
        converted(tmp_path, name, data)
    assert str(e.value) == message.format(p=tmp_path / name)


@pytest.mark.parametrize(
    "name, data",
    [
        ("bom-crlf.jsonl", b'\xef\xbb\xbf{"id": "a", "text": "x y"}\r\n{"id": "b", "text": "z"}\r\n'),
        ("bom-crlf.csv", b"\xef\xbb\xbfid,text\r\na,x y\r\nb,z\r\n"),
    ],
)
def test_bom_and_crlf_are_accepted_and_leave_no_trace(tmp_path: Path, name: str, data: bytes) -> None:
    assert converted(tmp_path, name, data) == [{"id": "a", "text": "x y"}, {"id": "b", "text": "z"}]


def test_unwritable_output_dir_stops_before_anything(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, 3)
    ro = tmp_path / "ro"
    ro.mkdir()
    args = ["run", f"input.path={corpus}", f"model.path={fake_model_dir(tmp_path)}", f"output.dir={ro}/run"]
    # Root writes through chmod: a read-only tmpfs in a private mount namespace is what refuses.
    script = f'mount -t tmpfs -o size=64k,ro tmpfs {ro} && exec "$0" -m batchinfer.cli "$@"'
    res = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, sys.executable, *args], capture_output=True, text=True, cwd=REPO
    )
    assert res.returncode == 2, res.stderr
    assert (
        f"batchinfer: error: output.dir {ro}/run: not writable (Read-only file system: {ro}); "
        "choose a writable output.dir" in res.stderr
    )
    assert "Traceback" not in res.stderr and os.listdir(ro) == []


# ---------------------------------------------------------------- the validate command


def test_validate_cli_exit_codes_and_no_engine_imports(tmp_path: Path, tiny_model_path: Path) -> None:
    bad = write_rows(tmp_path / "bad.jsonl", BAD_ROWS)
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def login(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", LOGIN_NODE, "validate", *args, *model_overrides(tiny_model_path)]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env)

    res = login(f"input.path={bad}", "input.id_column=id")
    assert "CODE 1 HEAVY []" in res.stdout, res.stderr
    assert "error rows   prompt: 5" in res.stdout
    assert "id 'missing': row 1: field 'text' is null or missing" in res.stdout
    assert not (tmp_path / "runs").exists()  # validate makes no run directory

    dup = write_rows(tmp_path / "dup.jsonl", [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}, {"id": "a"}])
    res = run_cli(["validate", "--json", f"input.path={dup}", "input.id_column=id", *model_overrides(tiny_model_path)])
    report = json.loads(res.stdout)
    assert res.returncode == 2 and report["exit_code"] == 2
    assert report["stops"]["by_kind"]["ids"]["examples"] == [
        {"message": f"{dup}: duplicate id 'a' in rows 0 and 2; ids must be unique"}
    ]
    assert report["error_rows"]["by_kind"]["prompt"]["count"] == 1  # reported too, though ids stop the run

    (tmp_path / "broken.jsonl").write_text('{"id": "a", "text": "x"}\n{"id": "b", text}\n')
    res = login(f"input.path={tmp_path / 'broken.jsonl'}")
    assert "CODE 2 HEAVY []" in res.stdout
    assert f"batchinfer: error: {tmp_path}/broken.jsonl:2: not valid JSON (Expecting property name" in res.stderr
    res = run_cli(["validate", f"input.path={bad}", f"model.path={tmp_path}/nope"])
    assert res.returncode == 2 and f"model.path {tmp_path}/nope: no model folder with a config.json there" in res.stderr
    assert "Traceback" not in res.stderr


# ---------------------------------------------------------------- many rows: processes, CPUs, samples


def bad_corpus(path: Path, copies: int) -> Path:
    """BAD_ROWS repeated, ids made unique but one (a duplicate of row 0's), so every kind of problem recurs."""
    rows = [dict(r, id=f"{r['id']}-{k}") for k in range(copies) for r in BAD_ROWS]
    rows[-1]["id"] = rows[0]["id"]
    return write_rows(path, rows)


def test_chunks_checked_apart_and_merged_in_order_equal_one_pass(tmp_path: Path, tiny_model_path: Path) -> None:
    from batchinfer.config.schema import to_config
    from batchinfer.inputs.convert import open_input
    from batchinfer.models.tokens import LoginTokenizer

    corpus = bad_corpus(tmp_path / "bad.jsonl", 3)
    c = to_config(compose(overrides(tiny_model_path, corpus, tmp_path / "run", "input.sampling_column=params")))
    convert_input([corpus], "jsonl", tmp_path / "input", "id", None, strict_ids=False)
    ds, tok = open_input(tmp_path / "input"), LoginTokenizer.from_model_dir(tiny_model_path)
    whole = check_rows(c, ds, tok, 128)
    merged = Checked()
    for start in range(0, 30, 4):  # chunks of 4 split the 5 prompt examples of rows 1-5 over two chunks
        merged.merge(check_rows(c, ds, tok, 128, range(start, min(start + 4, 30))))
    assert merged == whole
    prompt = whole.errors.kinds["prompt"]
    assert prompt["count"] == 15 and [e["row"] for e in prompt["examples"]] == [1, 2, 3, 4, 5]
    assert list(whole.errors.kinds) == ["prompt", "overlong", "sampling"]  # first seen first, as in one pass
    # Tokenized: ok, long (then overlong), number and bool; the sampling error comes before the prompt.
    assert whole.overlong == 3 and sum(whole.lengths.values()) == 3 * 4


def test_parallel_report_equals_one_process_report(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    corpus = bad_corpus(tmp_path / "bad.jsonl", 30)
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", "input.sampling_column=params")
    # Tiny chunks, so that 300 rows make 100 tasks for two worker processes, finishing in any order.
    monkeypatch.setattr(validate_module, "ROWS_PER_WORKER", 1)
    monkeypatch.setattr(validate_module, "MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr(validate_module, "CHUNK_ROWS", 3)
    monkeypatch.setattr(logging.getLogger("batchinfer"), "propagate", True)  # setup_logging turns it off
    caplog.set_level(logging.DEBUG, logger="batchinfer")
    for extra in ([], ["prompt.overlong=fail"]):
        one = validate(compose([*ov, *extra]), jobs=1)
        caplog.clear()
        assert validate(compose([*ov, *extra]), jobs=2) == one
        workers = [r.args[2] for r in caplog.records if "checked by worker processes" in r.msg]
        assert workers and os.getpid() not in workers[0]  # the rows were checked in other processes
    assert one["stops"]["by_kind"]["overlong"]["count"] == 30 and one["stops"]["by_kind"]["ids"]["count"] == 1
    report = validate(compose(ov), jobs=1)
    prompt = report["error_rows"]["by_kind"]["prompt"]
    assert prompt["count"] == 150 and [e["row"] for e in prompt["examples"]] == [1, 2, 3, 4, 5]
    assert report["prompt_tokens"]["rows"] == 30 * 4 and report["sample"] is None


def fake_proc(tmp_path: Path, cgroup: str, mounts: list[str]) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup + "\n")
    (proc / "mountinfo").write_text("".join(m + "\n" for m in mounts))
    return proc


def write_files(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text + "\n")


def test_allowed_cpus_honours_affinity_and_cgroup_quota(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    # cgroup v2, mounted at a path with a space (written \040), a quota of 2.5 CPUs on the user's
    # slice and none on the session below it: the slice's binds.
    v2 = tmp_path / "v2" / "cg root"
    proc = fake_proc(
        tmp_path / "v2",
        "0::/user.slice/user-1000.slice/session-3.scope",
        [f"30 1 0:26 / {str(v2).replace(' ', chr(92) + '040')} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"],
    )
    write_files(v2 / "user.slice/user-1000.slice", {"cpu.max": "250000 100000"})
    write_files(v2 / "user.slice/user-1000.slice/session-3.scope", {"cpu.max": "max 100000"})
    assert cgroup_cpu_limit(proc) == 2.5 and allowed_cpus(proc) == 3  # rounded up
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5})
    assert allowed_cpus(proc) == 2  # the affinity mask is smaller
    (v2 / "user.slice/user-1000.slice/cpu.max").write_text("max 100000\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cgroup_cpu_limit(proc) is None and allowed_cpus(proc) == 8  # no quota anywhere

    # cgroup v1 (cpu,cpuacct hierarchy) in a container whose mount root is its own cgroup: half a CPU -> 1.
    v1 = tmp_path / "v1" / "cpu,cpuacct"
    proc = fake_proc(
        tmp_path / "v1",
        "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc",
        [f"40 30 0:35 /docker/abc {v1} rw - cgroup cgroup rw,cpu,cpuacct"],
    )
    write_files(v1, {"cpu.cfs_quota_us": "50000", "cpu.cfs_period_us": "100000"})
    assert cgroup_cpu_limit(proc) == 0.5 and allowed_cpus(proc) == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert allowed_cpus(proc) == 8


def test_sample_checks_n_rows_spread_over_the_corpus(tmp_path: Path, tiny_model_path: Path) -> None:
    from batchinfer.models.tokens import LoginTokenizer

    # Row i has its own length (i+1 words) and every 7th row no text: which rows were tokenized
    # shows in the token total.
    rows = [{"id": f"r{i}", "text": None if i % 7 == 3 else " ".join(["hello"] * (i % 50 + 1))} for i in range(1000)]
    corpus = write_rows(tmp_path / "c.jsonl", rows)
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", "prompt.mode=raw")
    picked = Sample(1000, 40)[:]
    assert picked == Sample(1000, 40)[:] and len(set(picked)) == 40  # the same rows every time
    assert [r // 25 for r in picked] == list(range(40))  # one in each stretch of 25 rows
    assert len({r % 25 for r in picked}) > 10  # not at the same place in each stretch

    report = validate(compose(ov), sample=40)
    tok = LoginTokenizer.from_model_dir(tiny_model_path)
    good = [i for i in picked if rows[i]["text"] is not None]
    bad = [i for i in picked if rows[i]["text"] is None]
    assert bad and report["sample"]["rows"] == 40 and report["sample"]["of"] == 1000
    assert report["prompt_tokens"]["rows"] == len(good)
    assert report["prompt_tokens"]["total"] == sum(tok.count(rows[i]["text"]) for i in good)
    assert report["error_rows"]["count"] == len(bad) and report["would_run"] == 40 - len(bad)
    assert [e["row"] for e in report["error_rows"]["by_kind"]["prompt"]["examples"]] == bad[:5]
    est = report["sample"]["estimate"]
    assert est["error_rows"] == len(bad) * 25 and est["error_rows_95"][0] <= 143 <= est["error_rows_95"][1]
    assert est["prompt_tokens_total"] == report["prompt_tokens"]["total"] * 25

    res = run_cli(["validate", "--sample", "40", *ov])
    assert res.returncode == 1, res.stderr
    assert "sample       sampled 40 of 1,000 rows, one in each stretch of 25" in res.stdout
    assert f"error rows   prompt: {len(bad)} (~{len(bad) * 25:,} of all rows)" in res.stdout
    assert f"rows         {40 - len(bad)} of 40 sampled rows would run; ~{len(bad) * 25:,} of 1,000 rows" in res.stdout
    res = run_cli(["validate", "--jobs", "0", *ov])
    assert res.returncode == 2 and "batchinfer: error: --jobs 0: must be at least 1" in res.stderr


# ---------------------------------------------------------------- what validate used to call "ok"


def test_misspelt_sampling_column_stops_validate(tmp_path: Path, tiny_model_path: Path) -> None:
    """A sampling column that is not in the input would run every row with the config's sampling."""
    corpus = write_rows(tmp_path / "c.jsonl", [{"id": "a", "text": "hello", "params": {"temperature": 0.5}}])
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", "input.sampling_column=parms")
    with pytest.raises(ConfigError) as e:
        validate(compose(ov))
    assert str(e.value) == (
        f"input.sampling_column='parms' is not a column of {corpus} (did you mean input.sampling_column=params?); "
        "its columns are: id, text, params. Name the column that holds each row's sampling values, or unset it"
    )
    assert validate(compose([*ov[:-1], "input.sampling_column=params"]))["exit_code"] == 0


def test_openai_lines_a_pooling_task_cannot_run_are_predicted_error_rows(tmp_path: Path, tiny_model_path: Path) -> None:
    """task=embed on an OpenAI Batch file: chat and completion lines are error rows (as PoolingRows
    makes them), the /v1/embeddings line is tokenized as the worker embeds it."""
    from support.openai_batch import request

    from batchinfer.models.tokens import LoginTokenizer

    batch = tmp_path / "batch.jsonl"
    batch.write_text(
        request("chat", {"messages": [{"role": "user", "content": "hello"}]})
        + request("emb", {"input": "the quick brown fox"}, url="/v1/embeddings")
        + request("done", {"prompt": "hello world"}, url="/v1/completions")
    )
    report = validate(compose([f"input.path={batch}", *model_overrides(tiny_model_path), "task=embed"]))
    assert report["exit_code"] == 1 and report["would_run"] == 1
    unsupported = report["error_rows"]["by_kind"]["unsupported"]
    assert [(e["row"], e["id"]) for e in unsupported["examples"]] == [(0, "chat"), (2, "done")]
    assert unsupported["examples"][0]["message"] == (
        "row 0: a /v1/chat/completions request runs with task=generate, and this run has task=embed: submit "
        "those lines as their own run"
    )
    tok = LoginTokenizer.from_model_dir(tiny_model_path)
    assert report["prompt_tokens"]["rows"] == 1 and report["prompt_tokens"]["total"] == tok.count("the quick brown fox")


def test_score_rows_validate_as_a_bi_encoder_sends_them(tmp_path: Path, tiny_model_path: Path) -> None:
    """task=score (refused before: its texts are task.query and task.document, not prompt.template):
    each text tokenized as the worker sends it, a blank text an error row."""
    from batchinfer.models.tokens import LoginTokenizer

    rows = [
        {"id": "a", "q": "hello world", "d": "the quick brown fox"},
        {"id": "b", "q": "hello", "d": "   "},
        {"id": "c", "q": "", "d": "lazy dog"},
        {"id": "d", "q": "label this", "d": "abstract " * 200},  # over max_model_len=128: cut (truncate_right)
    ]
    corpus = write_rows(tmp_path / "pairs.jsonl", rows)
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", "task=score", "task.query={q}", "task.document={d}")
    report = validate(compose(ov))
    tok = LoginTokenizer.from_model_dir(tiny_model_path)
    assert report["exit_code"] == 1 and report["would_run"] == 2
    messages = {ex["id"]: ex["message"] for ex in report["error_rows"]["by_kind"]["prompt"]["examples"]}
    assert messages == {
        "b": "row 1: the prompt is empty (field 'd' is blank)",
        "c": "row 2: the prompt is empty (field 'q' is blank)",
    }
    counts = [tok.count(rows[i]["q"]) + tok.count(rows[i]["d"]) for i in (0, 3)]
    assert report["prompt_tokens"]["total"] == sum(counts) and report["overlong"]["rows"] == 1
    assert report["overlong"]["outcome"].startswith("1 row at or over max_model_len=128: cut at the end")
    stop = validate(compose([*ov, "prompt.overlong=fail"]))
    assert stop["exit_code"] == 2 and stop["stops"]["by_kind"]["overlong"]["examples"][0]["id"] == "d"


def cross_encoder(folder: Path) -> Path:
    """A BERT-style cross-encoder folder: config.json and a word-level tokenizer.json whose pairs are
    [CLS] a [SEP] b [SEP] (no weights: validate never loads them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = "what is tea rain a word hot drink made from leaves long".split()
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"architectures": ["BertForSequenceClassification"], "model_type": "bert", "hidden_size": 32}
    config |= {"max_position_embeddings": 64, "id2label": {"0": "LABEL_0"}}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_score_pairs_validate_as_a_cross_encoder_sends_them(tmp_path: Path) -> None:
    """A classifier scores (query, document) as one input: counted whole, the document cut to fit, and
    a query that alone leaves no room an overlong error row, as the engine's tokenizer refuses it."""
    model = cross_encoder(tmp_path / "rerank")
    rows = [
        {"q": "what is tea", "d": "a hot drink made from leaves"},  # [CLS] 3 [SEP] 6 [SEP]: 12 tokens
        {"q": "what is rain", "d": "a word " * 10},  # 1 + 3 + 1 + 20 + 1 = 26 > 16: the document is cut
        {"q": "long " * 20, "d": "tea"},  # 1 + 20 + 1 + 1 + 1 = 24: the query alone is over 16
    ]
    corpus = write_rows(tmp_path / "pairs.jsonl", rows)
    ov = [f"input.path={corpus}", f"model.path={model}", "model.max_model_len=16", "task=score"]
    report = validate(compose([*ov, "task.query={q}", "task.document={d}"]))
    assert report["prompt_tokens"]["total"] == 12 + 26 + 24 and report["overlong"]["rows"] == 2  # the error row too
    (error,) = report["error_rows"]["by_kind"]["overlong"]["examples"]
    assert error["row"] == 2 and error["message"].startswith("row 2: the pair cannot be cut to 16 tokens: ")
    assert report["would_run"] == 2 and report["exit_code"] == 1


def test_score_templates_are_checked_by_one_rule_in_validate_and_prepare(tmp_path: Path, tiny_model_path: Path) -> None:
    """prepare, validate and plan check a row's templates with one function: a score template's missing
    field is named with its key (task.document), not as prompt.template, wherever it is found."""
    from batchinfer.rundir.prepare import prepare

    corpus = write_rows(tmp_path / "pairs.jsonl", [{"id": "a", "q": "hello", "d": "world"}])
    ov = overrides(tiny_model_path, corpus, tmp_path / "run", "task=score", "task.query={q}", "task.document={passage}")
    for check in (validate, prepare):
        with pytest.raises(ConfigError, match=r"^task\.document uses \{passage\} but .*pairs\.jsonl has no column"):
            check(compose(ov))
