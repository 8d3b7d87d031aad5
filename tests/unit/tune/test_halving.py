"""Successive halving with a stand-in trial that answers from its setting: the better half goes on,
a failing setting is a row with its reason, one start per setting, output-changing settings are
never the winner."""

from __future__ import annotations

from batchinfer.tune.halving import Rung, TrialFailed, best, halve, in_better_half, rung_sizes, rungs_for
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
    # one engine start per setting, each stopped
    starts = [name for what, name in FakeTrial.log if what == "start"]
    assert starts == [s.name for s in settings]
    assert [n for w, n in FakeTrial.log if w == "stop"] == starts
    winner = best(outcomes)
    assert winner is not None and winner.setting.name == "model.max_num_seqs=512"  # fp8 is faster, never chosen
    assert winner.startup_seconds == 3.0 and winner.output_tokens_per_s == 150.0


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
