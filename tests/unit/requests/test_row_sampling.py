"""A row's own sampling values (input.sampling_column, an OpenAI request's body) are checked like the
config's: a wrong type or range, or n > 1 in a run that keeps one sample, is an error row of kind
`sampling` naming the key, never a TypeError that fails the shard (issue 26)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.corpus import read_output
from support.fake_engine import FakeEngine, fake_overrides, keyed

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.inputs.openai_batch import ROW_SAMPLING
from batchinfer.launch.local import run_shards
from batchinfer.requests.build import row_sampling
from batchinfer.requests.prompts import RowError
from batchinfer.rundir.merge import merge
from batchinfer.rundir.prepare import prepare

CFG = to_config(compose(["input.sampling_column=params"]))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"max_tokens": "8"}, "field 'params': max_tokens='8' is not an integer"),
        ({"max_tokens": 2.5}, "field 'params': max_tokens=2.5 is not an integer"),
        ('{"max_tokens": 0}', "field 'params': max_tokens=0 is out of range: it takes an integer in [1, 2^64)"),
        ({"temperature": "hot"}, "field 'params': temperature='hot' is not a number"),
        ({"top_p": 1.5}, "field 'params': top_p=1.5 is out of range: it takes a number in (0, 1]"),
        ({"stop": ["###", 1]}, "field 'params': stop=['###', 1] is not a string or a list of strings"),
        ({"stop": ""}, "field 'params': stop='' has an empty string"),
        ({"ignore_eos": 1}, "field 'params': ignore_eos=1 is not true or false: vLLM's engine takes no 1 or 0"),
        ({"max_tokens": True}, "field 'params': max_tokens=True is not an integer: true and false are not numbers"),
        ({"n": 3}, "field 'params' asks for n=3 samples, but this run keeps one per row (sampling.n=1)"),
    ],
)
def test_wrong_row_sampling_values_are_sampling_error_rows(params: object, message: str) -> None:
    with pytest.raises(RowError) as e:
        row_sampling(CFG, {"text": "x", "params": params}, "id-1")
    assert e.value.kind == "sampling" and e.value.message.startswith(message), e.value.message


def test_good_row_sampling_values_pass_as_canonical_json() -> None:
    own = row_sampling(CFG, {"text": "x", "params": {"max_tokens": 3, "temperature": 1, "stop": ["\n"]}}, 0)
    assert json.loads(own) == {"max_tokens": 3, "temperature": 1, "stop": ["\n"]}
    # as vLLM's SamplingParams takes them: one stop string, logprobs true (1)
    own = row_sampling(CFG, {"text": "x", "params": {"stop": "###", "logprobs": True}}, 0)
    assert json.loads(own) == {"stop": "###", "logprobs": True}
    many = to_config(compose(["input.sampling_column=params", "sampling.n=2", "sampling.temperature=0.8"]))
    assert json.loads(row_sampling(many, {"params": {"n": 4}}, 0)) == {"n": 4}  # kept: a samples column
    # an OpenAI request may ask for n samples: its rows have a samples column
    assert json.loads(row_sampling(CFG, {ROW_SAMPLING: json.dumps({"n": 2, "temperature": 1})}, 0)) == {
        "n": 2,
        "temperature": 1,
    }
    with pytest.raises(RowError, match=r"the request's body: max_tokens='9' is not an integer"):
        row_sampling(CFG, {ROW_SAMPLING: json.dumps({"max_tokens": "9"})}, 0)


def test_a_bad_max_tokens_on_an_overlong_row_is_a_sampling_error_row_not_a_failed_shard(tmp_path: Path) -> None:
    """The row's own max_tokens is checked before the overlong policy uses it (a str there was a
    TypeError that failed the shard)."""
    corpus = tmp_path / "c.jsonl"
    long = " ".join(["word"] * 400)  # longer than the fake engine's window
    rows = [
        {"id": "bad", "text": long, "params": json.dumps({"max_tokens": "8"})},  # JSON text: one column type
        {"id": "ok", "text": long, "params": json.dumps({"max_tokens": 8})},
    ]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = ["input.id_column=id", "input.sampling_column=params", "prompt.overlong=truncate_right"]
    run = prepare(compose(fake_overrides(tmp_path, corpus, *extra)))
    eng = FakeEngine()
    assert len(eng.encode([{"content": long}])) > eng.max_model_len
    run_shards(run, [0], engine=keyed(eng, run))
    merge(run)
    out = read_output(run.path)
    assert out[0]["error"] == {
        "kind": "sampling",
        "message": "row 0: field 'params': max_tokens='8' is not an integer",
    }
    assert out[1]["error"] is None and out[1]["prompt_tokens"] == eng.max_model_len - 8  # cut, room for its 8


def test_a_row_with_own_values_keeps_the_configs_schema_file(tmp_path: Path) -> None:
    """The config's structured_outputs.json names a file (frozen into DIR): a row's own max_tokens
    leaves it the run's constraint; only a schema string in the row's own data is refused (issue 41)."""
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    cfg = to_config(compose(["input.sampling_column=params", f"sampling.structured_outputs.json={schema}"]))
    assert json.loads(row_sampling(cfg, {"params": {"max_tokens": 3}}, 0)) == {"max_tokens": 3}
    with pytest.raises(RowError, match=r"structured_outputs.json=.* a JSON schema object written inline"):
        row_sampling(cfg, {"params": {"structured_outputs": {"json": str(schema)}}}, 0)
