"""The pilot sample keeps the corpus's prompt-length quantiles and its share of repeated prompts,
and the same seed draws the same sample."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support.runs import model_overrides

from batchinfer.tune.sample import draw_pilot, duplicate_share, quantiles


def corpus(rows: int = 4000, seed: int = 1) -> tuple[list[str], list[int]]:
    """Keys and lengths: skewed lengths, 25% of rows repeats in small groups, one prompt 200 times."""
    rng = random.Random(seed)
    keys, lengths = [], []
    n = 0
    while len(keys) < rows - 200:
        length = int(rng.lognormvariate(4, 0.8)) + 1
        copies = rng.choice([1, 1, 1, 1, 1, 2, 3, 4]) if rng.random() < 0.5 else 1
        keys += [f"p{n}"] * copies
        lengths += [length] * copies
        n += 1
    keys += ["heavy"] * 200
    lengths += [50] * 200
    order = list(range(len(keys)))
    rng.shuffle(order)
    return [keys[i] for i in order], [lengths[i] for i in order]


def test_pilot_keeps_length_quantiles_and_repeat_share() -> None:
    keys, lengths = corpus()
    pilot = draw_pilot(keys, lengths, 400, seed=3)
    assert len(pilot) == 400 and len(set(pilot)) == 400
    want, got = quantiles(lengths), quantiles([lengths[i] for i in pilot])
    for w, g in zip(want, got, strict=True):
        assert abs(g - w) <= 0.15 * w + 2, (want, got)
    corpus_share = duplicate_share(keys)
    pilot_share = duplicate_share([keys[i] for i in pilot])
    assert corpus_share > 0.2
    assert abs(pilot_share - corpus_share) < 0.05, (corpus_share, pilot_share)
    # the prompt repeated 200 times in 4000 rows is a twentieth of the pilot too
    assert 15 <= sum(1 for i in pilot if keys[i] == "heavy") <= 25


def test_uniform_sampling_would_lose_the_repeats() -> None:
    """What the grouping is for: a plain row sample of 10% keeps few of the pairs."""
    keys, lengths = corpus()
    plain = random.Random(3).sample(range(len(keys)), 400)
    assert duplicate_share([keys[i] for i in plain]) < duplicate_share(keys) - 0.1


def test_same_seed_same_sample_other_seed_another() -> None:
    keys, lengths = corpus()
    assert draw_pilot(keys, lengths, 300, seed=5) == draw_pilot(keys, lengths, 300, seed=5)
    assert set(draw_pilot(keys, lengths, 300, seed=5)) != set(draw_pilot(keys, lengths, 300, seed=6))


def test_a_pilot_as_large_as_the_corpus_is_the_corpus() -> None:
    keys, lengths = ["a", "b", "a", "c"] * 10, [3, 5, 3, 9] * 10
    assert sorted(draw_pilot(keys, lengths, 80, seed=0)) == list(range(40))


def test_identical_prompts_stay_together() -> None:
    """Copies of a prompt are consecutive in the pilot, so a rung holds them in one shard."""
    keys, lengths = corpus()
    seen: list[str] = []
    for i in draw_pilot(keys, lengths, 400, seed=2):
        if not seen or seen[-1] != keys[i]:
            assert keys[i] not in seen
            seen.append(keys[i])


def test_draw_reads_the_input_as_plan_counts_and_writes_the_pilot(tmp_path: Path, tiny_model_path: Path) -> None:
    """The real corpus path: prompts built and counted with the model's tokenizer; the pilot file holds
    the chosen input rows with their columns."""
    from batchinfer.config.compose import compose
    from batchinfer.models.tokens import LoginTokenizer
    from batchinfer.tune.command import draw

    rows = [{"id": f"r{i}", "text": f"hello world {i} " * (1 + i % 7)} for i in range(120)]
    rows += [{"id": f"d{i}", "text": "the quick brown fox"} for i in range(40)]  # one prompt 40 times
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose([f"input.path={path}", "input.id_column=id", *model_overrides(tiny_model_path)])
    prompts, pilot = draw(cfg, tmp_path / "tune", 40, seed=1)
    tok = LoginTokenizer.from_model_dir(tiny_model_path)
    assert prompts.unit == "tokens"
    assert prompts.lengths[0] == tok.count([{"role": "user", "content": rows[0]["text"]}])
    written = pq.read_table(tmp_path / "tune" / "pilot.parquet").to_pylist()
    assert [r["id"] for r in written] == [rows[i]["id"] for i in pilot]
    assert written[0]["text"] == rows[pilot[0]]["text"]
    assert duplicate_share([prompts.keys[i] for i in pilot]) == pytest.approx(duplicate_share(prompts.keys), abs=0.06)
