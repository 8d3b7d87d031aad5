"""Draw a small image corpus with Pillow: coloured shapes on coloured grounds, and a JSON lines
file naming each picture by a path relative to itself (what prompt.image_column reads).
usage: python make_images.py OUT_DIR [--count N]"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (240, 210, 20)}
SHAPES = ("square", "circle", "triangle")


def draw(shape: str, colour: str, ground: str, size: int, rng: random.Random) -> Image.Image:
    """One picture: a shape of one colour on a ground of another, somewhere in the frame."""
    img = Image.new("RGB", (size, size), COLOURS[ground])
    d = ImageDraw.Draw(img)
    r = rng.randint(size // 6, size // 3)
    x, y = rng.randint(r, size - r), rng.randint(r, size - r)
    box = (x - r, y - r, x + r, y + r)
    if shape == "square":
        d.rectangle(box, fill=COLOURS[colour])
    elif shape == "circle":
        d.ellipse(box, fill=COLOURS[colour])
    else:
        d.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=COLOURS[colour])
    return img


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=40)
    a = ap.parse_args()
    rng = random.Random(47)
    (a.out / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(a.count):
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        ground = rng.choice([c for c in COLOURS if c != colour])
        name = f"images/{i:04d}-{colour}-{shape}.png"
        draw(shape, colour, ground, 96, rng).save(a.out / name)
        rows.append({"id": f"img-{i:04d}", "image": name, "shape": shape, "colour": colour})
    with open(a.out / "images.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{len(rows)} images in {a.out / 'images'}, listed in {a.out / 'images.jsonl'}")


if __name__ == "__main__":
    main()
