"""The generate-seconds model of issue 48: the engine's batches replayed without an engine, the cost of
a step fitted on timed steps, the whole corpus's engine work counted on the login node, the step
clock around a trial's engine, and the estimate a forecast takes from them."""

from __future__ import annotations

import random
from array import array
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.parquet as pq
import pytest

from batchinfer.tune.batching import Limits, Load, Work, load, steps
from batchinfer.tune.costmodel import CostModel, fit, measure_steps, relative_error
from batchinfer.tune.estimate import estimate
from batchinfer.tune.forecast import GenerateModel, Layout, Measured, forecast
from batchinfer.tune.fullrun import cached_tokens, full_run
from batchinfer.tune.halving import Outcome, Rung
from batchinfer.tune.sample import GRAIN, Prompts, prefix_hashes
from batchinfer.tune.settings import Setting
from batchinfer.tune.stepclock import StepClock


def test_replay_fills_seats_then_decodes_one_token_a_step() -> None:
    # two seats: the first two prompts prefill in step 1 (each also gives its first token), decode
    # their last token in step 2, and only then the third gets a seat
    work = [Work(4, 2), Work(4, 2), Work(4, 2)]
    assert list(steps(work, max_num_seqs=2, budget=100)) == [(0, 8), (2, 0), (0, 4), (1, 0)]
    assert load(work, 2, 100) == Load(4, 3, 12)
    # with three seats they share every step: two steps in all
    assert list(steps(work, max_num_seqs=3, budget=100)) == [(0, 12), (3, 0)]


def test_replay_chunks_a_prompt_over_the_token_budget() -> None:
    assert list(steps([Work(5, 1)], max_num_seqs=4, budget=3)) == [(0, 3), (0, 2)]
    with pytest.raises(ValueError, match="must be positive"):
        list(steps([Work(5, 1)], max_num_seqs=0, budget=3))


def test_a_fuller_batch_needs_fewer_steps_for_the_same_tokens() -> None:
    work = [Work(20, 64)] * 256
    small, full = load(work, 32, 2048), load(work, 256, 2048)
    assert small.decodes == full.decodes == 256 * 63  # the same tokens decoded either way
    assert small.steps > 6 * full.steps  # but 32 seats take ~8 times the steps


def test_fit_recovers_the_cost_of_a_step() -> None:
    rng = random.Random(3)
    features = [(rng.randint(0, 200), rng.choice([0, 0, 0, rng.randint(1, 2000)])) for _ in range(400)]
    truth = CostModel(per_step=0.004, per_decode=0.0002, per_prefill=0.00001)
    durations = [truth.per_step + truth.per_decode * d + truth.per_prefill * p for d, p in features]
    stats = measure_steps(durations, features, generate_seconds=1.25 * sum(durations))
    model = fit(stats)
    assert model is not None
    assert model.per_step == pytest.approx(0.004, rel=1e-6)
    assert model.per_decode == pytest.approx(0.0002, rel=1e-6)
    assert model.per_prefill == pytest.approx(0.00001, rel=1e-6)
    assert model.overhead == pytest.approx(1.25)  # the worker's time around the steps
    assert model.seconds(stats.load) == pytest.approx(stats.generate_seconds)
    assert relative_error(model, [stats]) == pytest.approx(0.0, abs=1e-9)


def test_fit_never_gives_a_negative_cost() -> None:
    # prefill tokens that make steps faster (noise): that feature is dropped, not fitted negative
    features = [(10, 0), (10, 500), (20, 0), (20, 500), (30, 0)]
    durations = [0.02, 0.019, 0.03, 0.029, 0.04]
    model = fit(measure_steps(durations, features, sum(durations)))
    assert model is not None and min(model.per_step, model.per_decode, model.per_prefill) >= 0
    assert model.per_prefill == 0.0 and model.per_decode > 0
    assert fit(measure_steps([], [], 0.0)) is None


def test_a_block_is_served_from_the_cache_only_after_an_earlier_request_computed_it() -> None:
    a = list(range(100))
    b = list(range(64)) + [999] * 36  # the same first 64 tokens
    seen: set[int] = set()
    assert cached_tokens(prefix_hashes(a), len(a), 32, seen) == 0  # first: computes all
    assert cached_tokens(prefix_hashes(b), len(b), 32, seen) == 64  # two whole 32-token blocks shared
    assert cached_tokens(prefix_hashes(a), len(a), 32, seen) == 96  # itself again: all whole blocks
    assert cached_tokens(prefix_hashes(a[:64]), 64, 32, seen) == 32  # never the last token's block
    assert len(prefix_hashes(a)) == 100 // GRAIN


def prompts_of(ids: list[list[int]]) -> Prompts:
    """Prompts of these token ids, identical ids sharing a key."""
    return Prompts([str(i) for i in ids], [len(i) for i in ids], "tokens", [prefix_hashes(i) for i in ids])


LIMITS = Limits(max_num_seqs=256, max_num_batched_tokens=2048, block_size=32, prefix_caching=True)


def test_the_full_run_counts_repeats_within_a_shard_and_prefixes_per_engine() -> None:
    head = list(range(64))
    ids = [head + [1000 + i] * 10 for i in range(8)]
    ids[3] = ids[1]  # a repeat of row 1 in the same shard: one request
    ids[6] = ids[1]  # a repeat in the other shard: its own request
    prompts = prompts_of(ids)
    shards = [(0, 4), (4, 8)]
    one = full_run(prompts, shards, None, LIMITS, [5], seed=0)  # one engine runs both shards
    assert one.rows == 8 and one.requests == 7 and one.duplicate_share == pytest.approx(1 / 8)
    assert one.prompt_tokens == 7 * 74
    assert one.cached_tokens == 6 * 64  # every request after the first finds the 64-token head
    assert one.load.prefill == 7 * 74 - 6 * 64
    assert one.output_mean == 5.0
    two = full_run(prompts, shards, 1, LIMITS, [5], seed=0)  # an engine per shard: each computes the head
    assert two.cached_tokens == 5 * 64
    off = full_run(prompts, shards, None, Limits(256, 2048, 32, False), [5], seed=0)
    assert off.cached_tokens == 0 and off.prefix_share == 0.0


class FakeEngine:
    """What the worker's engine gives the step clock: add, step (completions), abort_all, and vLLM's
    config through `engine.vllm_config` (absent: a stand-in that does not say)."""

    max_num_seqs = 2

    def __init__(self, with_config: bool = True):
        self.queue: list[tuple[str, int]] = []
        self.added: list[tuple[str, dict[str, Any]]] = []
        if with_config:
            sched = SimpleNamespace(max_num_seqs=2, max_num_batched_tokens=64)
            cache = SimpleNamespace(block_size=32, enable_prefix_caching=True)
            self.engine = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=sched, cache_config=cache))

    def add(self, request_id: str, token_ids: list[int], params: Any, **kw: Any) -> None:
        self.queue.append((request_id, len(token_ids)))
        self.added.append((request_id, kw))

    def step(self) -> list[Any]:
        done, self.queue = self.queue[:1], self.queue[1:]
        return [SimpleNamespace(request_id=r, prompt_tokens=n, cached_tokens=None, output_tokens=3) for r, n in done]

    def abort_all(self) -> None:
        self.queue = []


def test_the_step_clock_times_steps_and_keeps_the_order_requests_were_sent() -> None:
    clock = StepClock(FakeEngine())
    clock.add("b", [1] * 40, None)
    clock.add("a", [1] * 10, None, adapter="x")
    assert clock.engine.added[1] == ("a", {"adapter": "x"})  # the worker's keyword reaches the engine
    while clock.step():
        pass
    assert len(clock.durations) == 3 and clock.max_num_seqs == 2  # other attributes pass through
    assert clock.work() == [Work(40, 3), Work(10, 3)]
    assert clock.limits() == Limits(2, 64, 32, True)
    stats = clock.stats(generate_seconds=1.0)
    assert stats is not None and stats.steps == 3 and stats.requests == 2 and stats.prefill == 50
    clock.reset()
    assert clock.work() == [] and clock.durations == []
    assert StepClock(FakeEngine(with_config=False)).limits() is None  # no batching known: no model


def config(rows: int, shards: int) -> Any:
    """What estimate reads of the config: the sharding and the cluster."""
    sh = SimpleNamespace(num_shards=shards, rows_per_shard=None)
    return SimpleNamespace(sharding=sh, cluster=SimpleNamespace(name="local", shards_per_task=1))


def test_the_estimate_prices_the_full_runs_steps_not_the_pilots_rate() -> None:
    # the pilot ran 48 requests on 32 seats: every step held at most 32 sequences (and fewer as
    # they finished, which tells the cost of a step from that of a sequence). The full run's 2,048
    # requests fill 256 seats, so its steps are 8x fewer for the same tokens: a rate taken from the
    # pilot forecasts far more seconds than the cost of a step does.
    truth = CostModel(per_step=0.01, per_decode=0.0001, per_prefill=0.00002)
    rng = random.Random(5)
    pilot_work = [Work(40, rng.randint(1, 64)) for _ in range(48)]
    features = list(steps(pilot_work, 32, 2048))
    durations = [truth.per_step + truth.per_decode * d + truth.per_prefill * p for d, p in features]
    stats = measure_steps(durations, features, sum(durations))
    stats.requests = len(pilot_work)
    outputs = [w.output for w in pilot_work]
    rung = Rung(0, 48, 48 * 40, sum(outputs), sum(durations), output_lengths=outputs)
    rung.steps, rung.limits = stats, Limits(256, 2048, 32, False)
    winner = Outcome(Setting(), 5.0, [rung])
    # distinct prompts of 40 tokens, no block shared
    prompts = Prompts([f"k{i}" for i in range(2048)], [40] * 2048, "tokens", [array("q", [i]) for i in range(2048)])
    est = estimate(winner, prompts, config(2048, 2), 1, outputs, None, seed=0)
    assert est.model is not None and est.full is not None and est.cost is not None
    expected = truth.seconds(est.full.load)
    mean = est.full.output_mean
    assert est.model.seconds(mean) == pytest.approx(expected, rel=1e-6)
    by_rate = 2048 * mean / rung.score  # what the pilot's rate says
    assert by_rate > 1.5 * expected
    assert "engine steps of up to 256 sequences" in est.note
    # the forecast takes the model's seconds; its interval widens with the speed's noise
    shape = Layout(rows=2048, array_tasks=1, engines_per_task=1, devices_per_engine=1, array_parallelism=1)
    measured = Measured([round(mean)] * 48, rung.score, 5.0, True, est.model, est.speed_sd)
    f = forecast(shape, measured, None, seed=0)
    assert f["generate_seconds"].value == pytest.approx(est.model.seconds(round(mean)), rel=1e-6)
    assert f["generate_seconds"].low < expected < f["generate_seconds"].high


def test_generate_seconds_scale_with_the_mean_output_but_not_the_prefill() -> None:
    m = GenerateModel(prefill_seconds=10.0, other_seconds=90.0, output_mean=30.0)
    assert m.seconds(30.0) == 100.0 and m.seconds(60.0) == 190.0


def test_a_run_through_the_step_clock_is_the_run_without_it(tmp_path: Path, tiny_model_path: Path) -> None:
    # the trial wraps its engine in the clock: the worker must see the same engine (same rows out),
    # and the clock must have seen every request it sent and every step
    from support.corpus import write_corpus
    from support.runs import run_overrides
    from support.standin import StandinEngine

    from batchinfer.config.compose import compose
    from batchinfer.launch.local import run_local

    rows = write_corpus(tmp_path / "in.jsonl", 30, seed=2)
    outputs = []
    clock = None
    for name in ("plain", "clocked"):
        cfg = compose(run_overrides(tiny_model_path, tmp_path / "in.jsonl", tmp_path / name))
        engine: Any = StandinEngine(cfg)
        if name == "clocked":
            engine.engine = FakeEngine().engine  # vLLM's config, as the real engine holds it
            engine = clock = StepClock(engine)
        run = run_local(cfg, engine=engine)
        outputs.append(pq.read_table(run.output_path).select(["id", "text", "output_tokens"]).to_pylist())
    assert outputs[0] == outputs[1] and len(outputs[0]) == len(rows)
    assert clock is not None
    stats = clock.stats(generate_seconds=1.0)
    assert (
        stats is not None
        and stats.requests == len({r["text"] for r in rows})
        and stats.steps == len(clock.durations) > 0
    )
    by_text = {r["text"]: o["output_tokens"] for r, o in zip(rows, outputs[1], strict=True)}  # one request each
    assert sum(w.output for w in clock.work()) == sum(by_text.values())
