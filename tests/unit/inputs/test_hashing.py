"""One 64-bit mixer (batchinfer/hashing.py): splitmix64 as Vigna's reference splitmix64.c computes it,
the same for a Python int (validate's sample) and over numpy arrays (the id check's hashes). No engine."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from batchinfer.hashing import GAMMA, MASK64, splitmix64, splitmix64_array
from batchinfer.inputs import idcheck

# Published: the first outputs of the test `reference` in rand_xoshiro (rust-random/rngs,
# rand_xoshiro/src/splitmix64.rs), "produced with the reference implementation" splitmix64.c, for
# the seed 1477776061723855037.
SEED = 1477776061723855037
REFERENCE = [
    1985237415132408290,
    2979275885539914483,
    13511426838097143398,
    8488337342461049707,
    15141737807933549159,
]
EDGES = [0, 1, 2, 0xFFFF_FFFF, 1 << 32, (1 << 63) - 1, 1 << 63, MASK64, SEED]


def test_splitmix64_gives_the_reference_stream() -> None:
    """The generator's n-th output is the mix of its state after n increments: splitmix64(seed + n * GAMMA)."""
    assert [splitmix64((SEED + n * GAMMA) & MASK64) for n in range(len(REFERENCE))] == REFERENCE
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # the first output for the seed 0
    assert splitmix64(MASK64 + 1) == splitmix64(0) and splitmix64(-1) == splitmix64(MASK64)  # mod 2**64


def test_the_array_form_agrees_with_the_scalar_one() -> None:
    values = EDGES + [(SEED + n * GAMMA) & MASK64 for n in range(len(REFERENCE))]
    h = np.array(values, np.uint64)
    out = splitmix64_array(h)
    assert out is h  # in place, as its callers rely on
    assert [int(v) for v in out] == [splitmix64(v) for v in values]
    assert [int(v) for v in splitmix64_array(np.array([(SEED + GAMMA) & MASK64], np.uint64))] == REFERENCE[1:2]


def test_the_id_check_hashes_with_the_one_mixer() -> None:
    """An int or bool id's hash is splitmix64 of its value (a string's mixes its 8-byte words the same way)."""
    ints = [0, 1, -1, 1 << 40, SEED]
    assert [int(v) for v in idcheck._id_hashes(pa.array(ints, pa.int64()))] == [splitmix64(v) for v in ints]
    assert [int(v) for v in idcheck._id_hashes(pa.array([True, False]))] == [splitmix64(1), splitmix64(0)]
