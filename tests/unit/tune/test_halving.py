"""Successive halving with a stand-in trial that answers from its setting: the better half goes on,
a failing setting is a row with its reason, one start per setting, output-changing settings are
never the winner."""

from __future__ import annotations

import pytest

from batchinfer.tune.halving import (
    Choice,
    Outcome,
    Rung,
    TrialFailed,
    best,
    choose,
    halve,
    in_better_half,
    noise,
    rung_sizes,
    rungs_for,
    separated,
)
from batchinfer.tune.settings import Setting

SPEED = {"defaults": 100.0, "model.max_num_seqs=64": 60.0, "model.max_num_seqs=512": 150.0}
SPEED["model.gpu_memory_utilization=0.99"] = 120.0  # good enough for rung 1, where it runs out of memory


class FakeTrial:
    """Answers each rung from the setting's speed; `fail` settings fail where they say."""

    log: list[tuple[str, str]] = []

    def __init__(self, setting: Setting):
        self.setting = setting

    def start(self, timeout: float) -> float:
        FakeTrial.log.append(("start", self.setting.name))
        if "model.max_num_batched_tokens=4" in self.setting.overrides:
            raise TrialFailed("ValueError: max_num_batched_tokens (4) must be greater than or equal to max_num_seqs")
        return 3.0

    def rung(self, index: int, timeout: float) -> Rung:
        FakeTrial.log.append(("rung", f"{self.setting.name}@{index}"))
        if "model.gpu_memory_utilization=0.99" in self.setting.overrides and index == 1:
            raise TrialFailed("OutOfMemoryError: CUDA out of memory")
        speed = SPEED.get(self.setting.name, 200.0 if self.setting.changes_outputs else 80.0)
        rows = 10 * 2**index
        return Rung(index, rows, rows * 5, rows * 8, rows * 8 / speed, output_lengths=[8] * rows)

    def stop(self) -> None:
        FakeTrial.log.append(("stop", self.setting.name))


def test_the_better_half_goes_on_and_failures_are_rows() -> None:
    settings = [
        Setting(),
        Setting(("model.max_num_seqs=64",)),
        Setting(("model.max_num_seqs=512",)),
        Setting(("model.max_num_batched_tokens=4",)),
        Setting(("model.gpu_memory_utilization=0.99",)),
        Setting(("quantization=fp8",), changes_outputs=True),
    ]
    FakeTrial.log = []
    outcomes = halve(settings, rungs_for(len(settings)), FakeTrial, 600.0)
    by = {o.setting.name: o for o in outcomes}
    assert [len(by[n].rungs) for n in by] == [3, 1, 3, 0, 1, 3]  # 64 falls out at rung 0; 0.99 fails at rung 1
    assert by["model.max_num_batched_tokens=4"].failure.startswith("ValueError: max_num_batched_tokens (4)")
    assert by["model.gpu_memory_utilization=0.99"].failure == "OutOfMemoryError: CUDA out of memory"
    assert by["model.max_num_seqs=64"].failure is None  # pruned, not failed
    # one engine start per setting, then the fastest and the config as composed once more each (their
    # top rung on a fresh engine): the stand-in's speeds never vary, so one repeat separates them
    starts = [name for what, name in FakeTrial.log if what == "start"]
    assert starts == [s.name for s in settings] + ["model.max_num_seqs=512", "defaults"]
    assert [n for w, n in FakeTrial.log if w == "stop"] == starts
    assert FakeTrial.log[-6:-3] == [
        ("start", "model.max_num_seqs=512"),
        ("rung", "model.max_num_seqs=512@2"),
        ("stop", "model.max_num_seqs=512"),
    ]
    winner = best(outcomes)
    assert winner is not None and winner.setting.name == "model.max_num_seqs=512"  # fp8 is faster, never chosen
    assert winner.startup_seconds == 3.0 and winner.output_tokens_per_s == 150.0
    assert winner.measures() == [150.0, 150.0] and by["defaults"].measures() == [100.0, 100.0]
    choice = choose(outcomes)
    assert choice.winner is winner and choice.reason.startswith("50% faster, measurements separate")


def test_every_setting_failing_has_no_winner() -> None:
    outcomes = halve([Setting(("model.max_num_batched_tokens=4",))], 1, FakeTrial, 60.0)
    assert best(outcomes) is None and outcomes[0].failure


def test_a_spent_budget_says_so() -> None:
    outcomes = halve([Setting(), Setting(("model.max_num_seqs=64",))], 2, FakeTrial, 0.0)
    assert all(o.failure == "not tried: the --minutes budget was spent" for o in outcomes)


def test_rank_and_rung_arithmetic() -> None:
    assert in_better_half(5.0, []) and in_better_half(5.0, [4.0]) and not in_better_half(3.0, [4.0])
    assert in_better_half(4.0, [5.0, 3.0]) and not in_better_half(3.0, [5.0, 4.0])
    assert rungs_for(1) == 1 and rungs_for(2) == 2 and rungs_for(3) == 3 and rungs_for(8) == 3
    assert rung_sizes(70, 3) == [10, 20, 40] and sum(rung_sizes(256, 4)) == 256


class NoisyTrial(FakeTrial):
    """Each engine start of a setting measures the next speed of its list (the same setting, measured
    again, differs)."""

    speeds: dict[str, list[float]] = {}  # rung 1 of each start in turn (rung 0: the first)

    def rung(self, index: int, timeout: float) -> Rung:
        rows = 10 * 2**index
        speeds = NoisyTrial.speeds[self.setting.name]
        speed = speeds[0] if index == 0 else speeds.pop(0)
        return Rung(index, rows, rows * 5, rows * 8, rows * 8 / speed, output_lengths=[8] * rows)


def test_a_lead_inside_the_tunes_noise_keeps_the_config_as_composed() -> None:
    # 112 against 100 at first, then 95 against 108: the same settings measured again cross over
    NoisyTrial.speeds = {"defaults": [100.0, 108.0, 104.0], "model.max_num_seqs=512": [112.0, 95.0, 101.0]}
    FakeTrial.log = []
    outcomes = halve([Setting(), Setting(("model.max_num_seqs=512",))], 2, NoisyTrial, 600.0)
    fast, base = outcomes[1], outcomes[0]
    assert best(outcomes) is fast  # fastest at the top rung as measured once
    assert len(fast.measures()) == 3 and len(base.measures()) == 3  # repeated twice each, never separating
    choice = choose(outcomes)
    assert choice.winner is base and choice.leader is fast
    assert "inside the tune's own noise" in choice.reason and choice.reason.endswith("keeping defaults")
    assert noise(outcomes) == pytest.approx((112 - 95) / ((112 + 95 + 101) / 3))


def test_a_lead_that_separates_is_the_winner_and_stops_repeating() -> None:
    NoisyTrial.speeds = {"defaults": [100.0, 98.0], "model.max_num_seqs=512": [150.0, 147.0]}
    FakeTrial.log = []
    outcomes = halve([Setting(), Setting(("model.max_num_seqs=512",))], 2, NoisyTrial, 600.0)
    assert outcomes[1].measures() == [150.0, 147.0] and outcomes[0].measures() == [100.0, 98.0]  # one repeat each
    assert choose(outcomes).winner is outcomes[1]


def test_a_lead_measured_once_is_not_called() -> None:
    fast = Outcome(Setting(("model.max_num_seqs=512",)), 1.0, [Rung(0, 10, 50, 80, 0.5)])
    base = Outcome(Setting(), 1.0, [Rung(0, 10, 50, 80, 0.8)])
    choice = choose([base, fast])
    assert choice.winner is base and "not repeated" in choice.reason


def test_separation_needs_two_measurements_each_and_a_gap_beyond_their_spread() -> None:
    assert not separated([150.0], [100.0])  # once each: the noise is unknown
    assert separated([150.0, 148.0], [100.0, 101.0])
    assert not separated([110.0, 104.0], [100.0, 103.0])  # 105.5 vs 101.5 is 3.9% apart; spread 5.7%
    assert not separated([120.0, 99.0], [100.0, 98.0])  # an overlap


def test_the_budget_keeps_room_for_the_repeats() -> None:
    clock = {"t": 0.0}

    class SlowTrial(FakeTrial):
        def start(self, timeout: float) -> float:
            clock["t"] += 40.0  # each trial takes 40 s of the budget
            return super().start(timeout)

    import batchinfer.tune.halving as halving

    real = halving.time.monotonic
    halving.time.monotonic = lambda: clock["t"]  # type: ignore[assignment]
    try:
        settings = [Setting(), Setting(("model.max_num_seqs=512",)), Setting(("model.max_num_seqs=64",))]
        outcomes = halve(settings, 1, SlowTrial, 150.0)
    finally:
        halving.time.monotonic = real  # type: ignore[assignment]
    # 150 s: the first trial (40 s) leaves 110 s > 80 s kept for two repeats, the second leaves 70 s
    assert outcomes[1].failure is None and outcomes[2].failure == (
        "not tried: the rest of the --minutes budget is kept to repeat the fastest"
    )
    assert len(outcomes[1].repeats) == 1 and len(outcomes[0].repeats) == 1  # the budget paid one repeat each


def test_a_slow_setting_cannot_eat_the_time_kept_for_the_repeats() -> None:
    clock = {"t": 0.0}
    timeouts: dict[str, float] = {}

    class Slow(FakeTrial):
        def start(self, timeout: float) -> float:
            timeouts.setdefault(self.setting.name, timeout)
            clock["t"] += 40.0
            return super().start(timeout)

        def rung(self, index: int, timeout: float) -> Rung:
            if self.setting.name == "model.max_num_seqs=64":  # runs over whatever it is given
                clock["t"] += timeout
                raise TrialFailed(f"over its time: rung {index} took more than {timeout:.0f} s")
            return super().rung(index, timeout)

    import batchinfer.tune.halving as halving

    real = halving.time.monotonic
    halving.time.monotonic = lambda: clock["t"]  # type: ignore[assignment]
    try:
        settings = [Setting(), Setting(("model.max_num_seqs=512",)), Setting(("model.max_num_seqs=64",))]
        outcomes = halve(settings, 1, Slow, 400.0)
    finally:
        halving.time.monotonic = real  # type: ignore[assignment]
    # the first trial took 40 s: 80 s are kept for one repeat of the leader and of the defaults, and
    # the slow setting (started at 80 s) is given until 320 s, not 400 s
    assert timeouts["model.max_num_seqs=64"] == 400 - 80 - 80
    assert outcomes[2].failure == "over its time: rung 0 took more than 200 s"
    # the kept 80 s paid a repeat of each, which separated them
    assert len(outcomes[1].repeats) == 1 and len(outcomes[0].repeats) == 1
    assert choose(outcomes).winner is outcomes[1]


def test_the_config_as_composed_is_the_baseline_wherever_it_was_tried() -> None:
    # `--try 'model.max_num_seqs=8 ...' --try defaults`: the first setting failed, the second is the
    # config as composed; it is what a leader is measured against, and here the only one that ran
    refused = Outcome(Setting(("model.max_num_batched_tokens=4",)), failure="ValueError: refused")
    plain = Outcome(Setting(), 1.0, [Rung(0, 10, 50, 80, 0.8)])
    assert choose([refused, plain]) == Choice(plain, plain, "the fastest measured")
