"""The settings a tune tries: throughput knobs that leave outputs unchanged, and, only when asked
(--include), settings that change outputs, marked as such."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Optional

from batchinfer.errors import ConfigError
from batchinfer.redaction import is_secret_name, strike_override
from batchinfer.security import refuse_secret_in, secret_value

MAX_NUM_SEQS = (64, 128, 512)
MAX_NUM_BATCHED_TOKENS = (2048, 4096, 16384)
GPU_MEMORY_UTILIZATION = (0.8, 0.95)
MAX_ENGINE_COUNTS = 3  # engines per task tried on a whole node: the largest few that divide it
# Settings that change outputs: tried only with --include NAME, never chosen as the winner.
OUTPUT_CHANGING = {
    "fp8": ("quantization=fp8",),
    "kv-fp8": ("quantization=kv-fp8",),
    "ngram": ("speculative=ngram",),
}


@dataclass(frozen=True)
class Setting:
    """One point of the grid: Hydra overrides on top of the user's, the environment its engine
    starts with, and whether it may change outputs."""

    overrides: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    changes_outputs: bool = False

    @property
    def name(self) -> str:
        """How the table names it: its overrides (and environment), `defaults` for none."""
        parts = [*self.overrides, *(f"{k}={v}" for k, v in sorted(self.env.items()))]
        return " ".join(parts) or "defaults"

    def override_strings(self) -> list[str]:
        """What `run`/`submit` take on their command line to reproduce it; the environment as
        cluster.env keys (`++`: cluster.env is an open dict, where Hydra refuses a plain new key)."""
        return [*self.overrides, *(f"++cluster.env.{k}={v}" for k, v in sorted(self.env.items()))]


def parse_include(text: Optional[str]) -> list[str]:
    """--include fp8,kv-fp8,ngram as names; an unknown name is refused, naming the known ones."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in OUTPUT_CHANGING]
    if unknown:
        raise ConfigError(f"--include {unknown[0]}: unknown; it takes {', '.join(OUTPUT_CHANGING)} (comma-separated)")
    return names


def parse_tries(tries: list[str]) -> list[Setting]:
    """--try 'k=v k=v' (repeatable): the grid given by hand; `defaults` is the config as composed."""
    out = []
    for text in tries:
        words = [] if text.strip() == "defaults" else shlex.split(text)
        bad = [w for w in words if "=" not in w]
        if bad:
            raise ConfigError(f"--try {text!r}: {bad[0]!r} is not a key=value override")
        for word in words:
            _refuse_secret_keys_inside(word)
        env = {w.split("=", 1)[0].removeprefix("env."): w.split("=", 1)[1] for w in words if w.startswith("env.")}
        # a secret struck in TUNE/job.json: the tune job's environment carries it (security.submission_env)
        env = {k: secret_value(k, v, f"env.{k}", f"the tune folder (--try {text!r})") for k, v in env.items()}
        _refuse_secret_values(words, env)
        out.append(Setting(tuple(w for w in words if not w.startswith("env.")), env))
    return out


# Where a --try's words are kept as typed, but a secret-named key's value (redaction.exact).
TRY_RECORDS = "the tune folder keeps it as typed (job.json, each trial's spec.json, conf/tuned/best.yaml)"


def _refuse_secret_keys_inside(word: str) -> None:
    """A --try word whose value is a dict naming a secret-named key (`+cluster.env={HF_TOKEN:x}`) is
    refused, as one Hydra cannot parse is (compose.secret_parse_error): the tune folder keeps a word's
    value as typed, and only the dot form (`+cluster.env.HF_TOKEN=x`) has its value struck there and
    carried in the job's environment (H2)."""
    from batchinfer.config.compose import secret_keys_inside, secret_parse_error

    unreadable = secret_parse_error(word)
    if unreadable:
        raise ConfigError(f"--try {unreadable}")
    key, _, value = word.partition("=")
    inside = secret_keys_inside(value)
    if inside and strike_override(word) == word:
        name = key.lstrip("+~")
        raise ConfigError(
            f"--try {name}: its value is a dict holding {', '.join(dict.fromkeys(inside))}, a secret, which "
            f"the tune folder would keep as typed; give each entry as its own word in the dot form, such "
            f"as --try '+{name}.{inside[0]}=...' (its value is struck there and travels in the job's environment)"
        )


def _refuse_secret_values(words: list[str], env: dict[str, str]) -> None:
    """A --try's values kept as typed (every one a secret-named key's is not) hold no secret's value
    nor a URL's password, as compose refuses one in a config value: the env.NAME ones as resolved
    (`env.PLAIN=${oc.env:HF_TOKEN}` would put HF_TOKEN's value under a name that is no secret's)."""
    for word in words:
        key, _, value = word.partition("=")
        if not key.startswith("env.") and strike_override(word) == word:
            refuse_secret_in(f"--try {key}", value, record=TRY_RECORDS)
    for name, value in env.items():
        if strike_override(f"env.{name}={value}") == f"env.{name}={value}":
            refuse_secret_in(f"--try env.{name}", value, record=TRY_RECORDS)


def try_secrets(tries: list[str]) -> dict[str, str]:
    """The secret env.NAME values the tries give (redaction.is_secret_name): a tune job gets them
    in its environment, never from TUNE/job.json; one name with two values is refused."""
    out: dict[str, str] = {}
    for setting in parse_tries(tries):
        for name, value in setting.env.items():
            if is_secret_name(name) and out.setdefault(name, value) != value:
                raise ConfigError(
                    f"--try gives env.{name} two values; a secret travels in the tune job's environment, "
                    f"which holds one: tune each value in its own tune (--out)"
                )
    return out


def engine_counts(c: Any, gpus: int, cpus: list[int]) -> list[int]:
    """cluster.engines_per_task values to try besides the config's own, for a task of `gpus` GPUs
    (0: a CPU task on `cpus`): on GPUs each N >= 2 whose N x TP x PP GPUs divide the task's (the
    largest MAX_ENGINE_COUNTS of them); on two or more cores 2, or 1 when the config runs several
    engines already. None for an engine over several nodes, which takes the whole task."""
    from batchinfer.config.engines import engines_per_task, gpus_per_engine

    if int(c.cluster.nodes_per_task) != 1:
        return []
    try:
        now = engines_per_task(c, gpus)
    except ConfigError:
        return []  # the config as composed cannot run: its own trial says why
    if gpus:
        each = gpus_per_engine(c)
        fits = [n for n in range(2, gpus // each + 1) if gpus % (n * each) == 0]
        # fewer engines than the config runs would leave GPUs of the task idle: never faster per node
        return [n for n in fits[-MAX_ENGINE_COUNTS:] if n > now]
    if len(cpus) < 2:
        return []
    return [1] if now > 1 else [2]


def lora_slots(c: Any) -> list[int]:
    """model.lora.max_loras values to try besides the config's own (unset: every adapter at once) for a
    run of two or more LoRA adapters: one slot (least memory, the worker then takes the adapters one
    after another) and every adapter (no adapter waits for a slot). Outputs do not change."""
    adapters = len(c.model.lora.adapters or {})
    if adapters < 2:
        return []
    now = c.model.lora.max_loras or adapters
    return [v for v in (1, adapters) if v != now]


def default_grid(c: Any, gpus: int, cpus: list[int], include: list[str]) -> list[Setting]:
    """The config as composed first, then one knob at a time around it: max_num_seqs,
    max_num_batched_tokens, gpu_memory_utilization (GPUs), LoRA adapter slots (lora_slots), the OpenMP binding of every allowed core
    (CPU), cluster.engines_per_task where the task holds several GPUs or cores (engine_counts);
    then the output-changing settings asked for. A trial of several engines runs each rung as a
    task does (tune/trial.py), so its rate is the task's, all engines together: settings compare
    per node, and the forecast divides it by the engines."""
    from batchinfer.config.engines import engine_envs

    m = c.model
    grid = [Setting()]
    grid += [Setting((f"model.max_num_seqs={v}",)) for v in MAX_NUM_SEQS if v != m.max_num_seqs]
    grid += [
        Setting((f"model.max_num_batched_tokens={v}",)) for v in MAX_NUM_BATCHED_TOKENS if v != m.max_num_batched_tokens
    ]
    if gpus:
        grid += [
            Setting((f"model.gpu_memory_utilization={v}",))
            for v in GPU_MEMORY_UTILIZATION
            if v != m.gpu_memory_utilization
        ]
    grid += [Setting((f"model.lora.max_loras={v}",)) for v in lora_slots(c)]
    counts = engine_counts(c, gpus, cpus)
    if not gpus and len(cpus) > 1:
        # vLLM's default binding (`auto`) keeps a core for its scheduler; every core was measured
        # at 1.38x that on a 2-core machine. Several engines bind their own cores (engine_envs):
        # the binding is tried with one engine.
        every_core = engine_envs(c, 1, [], cpus)[0]
        one = ("cluster.engines_per_task=1",) if counts == [1] else ()
        grid.append(Setting(one, env=every_core))
        counts = [n for n in counts if n != 1]
    grid += [Setting((f"cluster.engines_per_task={n}",)) for n in counts]
    grid += [Setting(OUTPUT_CHANGING[name], changes_outputs=True) for name in include]
    return grid
