"""A tune folder as `batchinfer tune` leaves it (tune.json + conf/tuned/best.yaml), made without an
engine: the forecast from tune's own arithmetic over given pilot output lengths, rate and start-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from batchinfer.config.compose import compose
from batchinfer.config.schema import to_config
from batchinfer.tune import results
from batchinfer.tune.command import config_fingerprint, layout
from batchinfer.tune.forecast import Measured, as_json, forecast

WINNER = ["model.max_num_seqs=8", "model.max_num_batched_tokens=1024"]
LENGTHS = [6] * 10 + [3] * 10  # pilot output tokens per row: mean 4.5, a real interval
RATE = 0.5  # output tokens/s: slow, so GPU-hours are large enough to read
STARTUP = 600.0


def make_tune(
    folder: Path,
    overrides: list[str],
    price: Optional[float] = None,
    winner: Optional[list[str]] = None,
    fingerprint: Optional[str] = None,
) -> dict[str, Any]:
    """Write folder/tune.json and folder/conf/tuned/best.yaml for the config of overrides; the result."""
    plain, fp = config_fingerprint(compose(overrides))
    c = to_config(plain)
    rows = sum(1 for _ in Path(c.input.path).open())
    shape = layout(c, rows)
    winner = WINNER if winner is None else winner
    group = results.write_group(folder, winner)
    result = {
        "version": 1,
        "created": "2026-12-03T02:00:00Z",
        "fingerprint": fingerprint or fp,
        "overrides": overrides,
        "config_dir": None,
        "folder": str(folder),
        "sample": {"rows": rows, "pilot_rows": len(LENGTHS)},
        "settings": [
            {"name": "defaults", "overrides": [], "startup_seconds": 700.0, "output_tokens_per_s": 0.4},
            {"name": " ".join(winner), "overrides": winner, "startup_seconds": STARTUP, "output_tokens_per_s": RATE},
        ],
        "best": {"name": " ".join(winner), "overrides": winner, "config_group": str(group), "use": "..."},
        "output_lengths": {},
        "layout": shape.__dict__,
        "price": {"usd_per_gpu_hour": price, "source": "--gpu-hour-price" if price is not None else None},
        "forecast": as_json(forecast(shape, Measured(LENGTHS, RATE, STARTUP), price, 0)),
    }
    results.write_json(folder, result)
    return result
