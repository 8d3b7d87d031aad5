"""Helpers shared by the test folders: corpora, runs, subprocesses, the stand-in engine, Slurm."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout
TESTS = REPO / "tests"  # on sys.path (tests/conftest.py): `import support` works from every folder
