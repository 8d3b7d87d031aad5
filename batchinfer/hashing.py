"""splitmix64, the one 64-bit mixer: a well-spread hash of a 64-bit value, for a Python int and for
each value of a numpy uint64 array. A base module: it imports nothing of batchinfer."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

MASK64 = (1 << 64) - 1
# Vigna's splitmix64.c (https://prng.di.unimi.it/splitmix64.c): the state's increment, then the
# finalizer's two multipliers.
GAMMA = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB


def splitmix64(x: int) -> int:
    """splitmix64's output for state x (taken mod 2**64): x plus its increment, then the finalizer."""
    x = (x + GAMMA) & MASK64
    x = ((x ^ (x >> 30)) * M1) & MASK64
    x = ((x ^ (x >> 27)) * M2) & MASK64
    return x ^ (x >> 31)


def splitmix64_array(h: np.ndarray) -> np.ndarray:
    """splitmix64 of each value of a uint64 array, computed in place: h is overwritten and returned."""
    import numpy as np  # only the array form needs it

    # In place: every caller passes an array of its own, and ids come by the million.
    h += np.uint64(GAMMA)
    h ^= h >> np.uint64(30)
    h *= np.uint64(M1)
    h ^= h >> np.uint64(27)
    h *= np.uint64(M2)
    h ^= h >> np.uint64(31)
    return h
