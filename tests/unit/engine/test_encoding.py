"""A window's prompts rendered and tokenized together (issue 44) give each prompt exactly the ids
one prompt at a time gives, a chat its template refuses gets its own exception, and the request
digest is the bytes it always was; requests made ahead on a helper thread come in input order, with
a failure raised where its row is taken."""

from __future__ import annotations

import hashlib
import threading
from array import array
from pathlib import Path
from typing import Any

import pytest

from batchinfer.engine import encoding, phases
from batchinfer.engine.ahead import Ahead
from batchinfer.engine.phases import PhaseClock
from batchinfer.errors import Stopped
from batchinfer.requests.request import RequestKey, request_digest

CHATS: list[Any] = [
    [{"role": "user", "content": "the quick brown fox"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world, again"}],
    "a raw prompt, tokenized with special tokens",
    [{"role": "narrator", "content": "a role the template refuses"}],
    [{"role": "user", "content": "label this abstract as physics or biology " * 20}],
    "",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def one_at_a_time(tok: Any, prompts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for p in prompts:
        try:
            out.append(encoding.encode_one(tok, p))
        except Exception as e:
            out.append(e)
    return out


def test_a_window_encoded_together_gives_each_prompt_its_own_ids(tokenizer: Any) -> None:
    assert encoding._plain_backend(tokenizer) is not None  # the batch call is the one taken
    rendered = encoding.render_many(tokenizer, CHATS)
    assert (
        3 in rendered.done and len(rendered.chats) == 3 and len(rendered.raw) == 2
    )  # the refused chat is known at once
    together = rendered.tokens()
    alone = one_at_a_time(tokenizer, CHATS)
    refused = [i for i, x in enumerate(alone) if isinstance(x, Exception)]
    assert refused == [3] and "unknown role narrator" in str(together[3])
    assert [x for i, x in enumerate(together) if i != 3] == [x for i, x in enumerate(alone) if i != 3]
    assert all(len(x) > 0 for i, x in enumerate(together) if i not in (3, 5))  # type: ignore[arg-type]
    # and as vLLM counts: the rendered chat tokenized without special tokens
    text = tokenizer.apply_chat_template(CHATS[1], tokenize=False, add_generation_prompt=True)
    assert together[1] == tokenizer.encode(text, add_special_tokens=False)


def test_a_tokenizer_that_decides_ids_itself_is_asked_text_by_text(tokenizer: Any) -> None:
    """A class that overrides encode (as vLLM's thread-pool wrapper does) or truncation set on the
    backend: the texts go through tokenizer.encode one by one, so the ids stay its own."""

    class Own(type(tokenizer)):  # type: ignore[misc]
        def encode(self, text: Any, *args: Any, **kwargs: Any) -> Any:
            return [7, *super().encode(text, *args, **kwargs)]

    own = Own.from_pretrained(tokenizer.name_or_path)
    assert encoding._plain_backend(own) is None
    assert encoding.tokenize(own, ["hello world"], False) == [
        [7, *tokenizer.encode("hello world", add_special_tokens=False)]
    ]
    cut = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    cut._tokenizer.enable_truncation(3)
    assert encoding._plain_backend(cut) is None
    ours = encoding.tokenize(cut, ["the quick brown fox jumps"], False)
    assert ours == [cut.encode("the quick brown fox jumps", add_special_tokens=False)]
    assert len(ours[0]) > 3  # transformers' own encode does not truncate unless asked


def test_an_engine_without_render_many_encodes_prompt_by_prompt() -> None:
    class Plain:
        def encode(self, prompt: Any, kwargs: Any = None) -> list[int]:
            if prompt == "bad":
                raise ValueError("refused")
            return [len(prompt)]

    got = encoding.render_all(Plain(), ["ab", "bad", "abcd"]).tokens()
    assert got[0] == [2] and isinstance(got[1], ValueError) and got[2] == [4]


def test_request_digest_is_the_int64_bytes_it_always_was() -> None:
    """The request_digest column and output.reuse depend on these bytes: blake2b of the ids as
    native int64, then the row's own sampling."""
    for ids, own in (((1, 2, 3), ""), (tuple(range(49_000, 49_300)), '{"seed": 1}'), ((), ""), ((2**40,), "x")):
        old = hashlib.blake2b(array("q", ids).tobytes(), digest_size=16)
        old.update(own.encode())
        assert request_digest(ids, own) == old.digest()
        key = RequestKey(ids, own)
        assert key.digest() == old.digest() and key.digest() is key.digest()  # taken once


def test_request_keys_equal_by_ids_own_and_row() -> None:
    a, b = RequestKey((1, 2), ""), RequestKey((1, 2), "")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != RequestKey((1, 2), "", own_row=5) and a != RequestKey((1, 2), "x") and a != RequestKey((1, 3), "")
    assert a.shared and not RequestKey((1,), "", 0).shared


def made(indices: list[int]) -> list[int]:
    return indices


def tokenized(indices: list[int]) -> None:
    tokenized_slices.append(list(indices))


tokenized_slices: list[list[int]] = []


def finished(indices: list[int]) -> list[tuple[int, Any]]:
    return [(i, ValueError(f"row {i} is bad") if i == 7 else f"req-{i}") for i in indices]


def ahead(slices: list[list[int]], begin: Any = made, depth: int = 2, check: Any = None, stopping: Any = None) -> Ahead:
    return Ahead(iter(slices), begin, tokenized, finished, depth, check or (lambda: None), stopping or (lambda: False))


def test_requests_made_ahead_come_in_input_order_and_a_failure_where_its_row_is() -> None:
    tokenized_slices.clear()
    made_ahead = ahead([[0, 1, 2], [3, 4], [5, 6, 7, 8]])
    taken = []
    with pytest.raises(ValueError, match="row 7 is bad"):
        for index, request in made_ahead:
            taken.append((index, request))
    made_ahead.close()
    assert taken == [(i, f"req-{i}") for i in range(7)]
    assert tokenized_slices == [[0, 1, 2], [3, 4], [5, 6, 7, 8]]  # each slice tokenized once, in order


def test_a_slice_that_cannot_be_read_fails_where_it_starts() -> None:
    def read(indices: list[int]) -> list[int]:
        if indices[0] == 3:
            raise OSError(5, "Input/output error")
        return indices

    made_ahead = ahead([[0, 1, 2], [3, 4], [5]], begin=read, depth=4)
    it = iter(made_ahead)
    assert [next(it) for _ in range(3)] == [(0, "req-0"), (1, "req-1"), (2, "req-2")]
    with pytest.raises(OSError, match="Input/output error"):
        next(it)
    made_ahead.close()


def test_a_pending_stop_ends_the_making_and_a_waiting_taker_stops() -> None:
    stop = threading.Event()
    calls: list[list[int]] = []

    def slow(indices: list[int]) -> list[int]:
        calls.append(indices)
        stop.set()  # a stop signal arrives while the first slice is made
        return indices

    def check() -> None:
        if stop.is_set():
            raise Stopped(12)

    made_ahead = ahead([[0], [1], [2], [3]], begin=slow, depth=1, check=check, stopping=stop.is_set)
    with pytest.raises(Stopped):
        next(iter(made_ahead))
    made_ahead.close()
    assert calls == [[0]]  # no slice begun after the stop


class Cycle:
    """An object in a reference cycle: only the garbage collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_the_collector_sets_start_up_objects_aside_while_a_shard_streams_and_is_restored_after() -> None:
    """While requests are made ahead, what the process held before is frozen and young collections
    are rarer (their walks cost ~40 µs a row, issue 44); after the stream, even one that failed, the
    collector is as it was and a cycle dropped meanwhile is collected (a closed vLLM engine's shared
    memory is unlinked when its objects are collected)."""
    import gc
    import weakref

    from batchinfer.engine.ahead import GC_YOUNG

    before = gc.get_threshold()
    held = Cycle()
    gone = weakref.ref(held)
    seen: list[tuple[int, int]] = []

    def begin(indices: list[int]) -> list[int]:
        seen.append((gc.get_freeze_count(), gc.get_threshold()[0]))
        return indices

    made_ahead = ahead([[0, 1, 2], [3, 4], [5, 6, 7, 8]], begin=begin)
    taken = []
    with pytest.raises(ValueError, match="row 7 is bad"):
        for index, _ in made_ahead:
            taken.append(index)
            if index == 0:
                del held  # dropped while frozen: not collected yet
                gc.collect()
                assert gone() is not None
    made_ahead.close()
    assert taken == [0, 1, 2, 3, 4, 5, 6]
    assert all(frozen > 0 and young >= GC_YOUNG for frozen, young in seen)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before
    gc.collect()
    assert gone() is None


class FakeTime:
    """thread_time and perf_counter that move only when told (seconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def thread_time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


def test_phase_clock_counts_a_nested_phase_once_and_costs_nothing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeTime()
    monkeypatch.setattr(phases, "time", fake)
    clock = PhaseClock()
    assert clock("render") is clock("tokenize")  # off: one shared do-nothing timer
    with clock("render"):
        fake.now += 1
    assert clock.figures() == {}
    clock.enable()
    with clock("dedup"):
        fake.now += 2
        with clock("order"):
            fake.now += 5
        fake.now += 1
    with clock("order"):
        fake.now += 4
    got = clock.figures()
    assert got == {
        "dedup": {"cpu_s": 3.0, "wall_s": 3.0, "calls": 1},  # its own seconds, not the inner phase's
        "order": {"cpu_s": 9.0, "wall_s": 9.0, "calls": 2},
    }
