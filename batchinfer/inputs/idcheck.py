"""Row ids checked present and unique, on 64-bit hashes of the ids (8 bytes a row), the duplicates
named by row."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import pyarrow as pa
import pyarrow.compute as pc

from batchinfer.errors import InputError
from batchinfer.hashing import splitmix64_array

IdChunks = Callable[[], Iterable[pa.Array]]


class IdHashes:
    """The 64-bit hashes of a column's non-null ids, taken chunk by chunk while the column is written
    (`add`), so that checking the ids needs no pass over them unless one is null or repeats: 8 bytes
    a row. `usable` is False for ids without such a hash (lists, structs). `increasing`: every id
    so far greater than the one before (row numbers, ids written in order), which makes them unique
    without a hash: while they increase none is taken, and ids that stop increasing after a chunk
    make the hashes unusable (the check hashes the column it reads again, as for ids never hashed)."""

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.rows = 0
        self.nulls = 0
        self.usable = True
        self.increasing = True
        self.unhashed = 0  # chunks not hashed, the ids increasing through them
        self.last: Optional[pa.Scalar] = None

    def add(self, chunk: pa.Array) -> None:
        """The hashes of one more chunk of the column, in row order."""
        self.rows += len(chunk)
        self.nulls += chunk.null_count
        if not self.usable:
            return
        chunk = _plain(chunk)
        if self.increasing:
            self._still_increasing(chunk)
            if self.increasing:  # unique without a hash (~0.06 s per 1M ids saved)
                self.unhashed += 1
                return
            if self.unhashed:  # the chunks before went unhashed: the check hashes the written column
                self.usable, self.parts = False, []
                return
        h = _id_hashes(chunk)
        if h is None:
            self.usable, self.parts = False, []
            return
        self.parts.append(h[chunk.is_valid().to_numpy(zero_copy_only=False)] if chunk.null_count else h)

    def _still_increasing(self, chunk: pa.Array) -> None:
        """Whether the ids stay strictly increasing through chunk (Arrow's order: bytes for text)."""
        if chunk.null_count or not len(chunk):
            self.increasing = self.increasing and not chunk.null_count
            return
        try:
            steps = pc.less(chunk.slice(0, len(chunk) - 1), chunk.slice(1))
            joined = self.last is None or pc.less(self.last, chunk[0]).as_py()
            self.increasing = bool(joined) and (len(chunk) < 2 or pc.all(steps).as_py() is True)
        except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
            self.increasing = False  # a type Arrow does not order
        self.last = chunk[len(chunk) - 1]

    def take_sorted(self) -> Any:
        """Every hash in one array, sorted in place; the parts are let go one by one, so the copy
        costs at most one part's bytes more."""
        import numpy as np

        hashes = np.empty(sum(len(h) for h in self.parts), np.uint64)
        at = 0
        self.parts.reverse()
        while self.parts:
            h = self.parts.pop()
            hashes[at : at + len(h)] = h
            at += len(h)
        hashes.sort()
        return hashes


def id_problems(
    ids: Union[pa.ChunkedArray, IdChunks], column: str, limit: int = 5, hashed: Optional[IdHashes] = None
) -> tuple[int, list[str]]:
    """Null and duplicate ids: how many rows have one, and the first `limit` in row order said as
    messages. ids is a column or a function giving its chunks anew for each pass over them; hashed,
    where given, holds their hashes already (taken as they were written): the ids are then read
    only to name a null or repeated one."""
    import numpy as np

    chunks: IdChunks = (lambda: ids.chunks) if isinstance(ids, pa.ChunkedArray) else ids  # type: ignore[union-attr]
    found: list[tuple[int, str]] = []  # (row, message), at most `limit` of each kind
    if hashed is not None and hashed.usable:
        if hashed.increasing and not hashed.nulls:
            return 0, []  # each id greater than the one before: none repeats
        nulls = _null_rows(chunks, limit, found, column)[0] if hashed.nulls else 0
        hashes = hashed.take_sorted()
    else:
        nulls, total = _null_rows(chunks, limit, found, column)
        # One 64-bit hash per id is all that is kept of the ids: 8 bytes a row, sorted in place.
        hashes = np.empty(total - nulls, np.uint64)
        at = 0
        for chunk in _grouped(chunks()):
            h = _id_hashes(chunk)
            if h is None:
                return nulls + _id_problems_python(chunks, limit, found), [msg for _, msg in sorted(found)[:limit]]
            h = h[chunk.is_valid().to_numpy(zero_copy_only=False)] if chunk.null_count else h
            hashes[at : at + len(h)] = h
            at += len(h)
        hashes.sort()
    repeated = np.unique(hashes[1:][hashes[1:] == hashes[:-1]])
    del hashes
    dups = _duplicates(*_with_hashes_in(chunks, repeated), limit, found) if len(repeated) else 0
    return nulls + dups, [msg for _, msg in sorted(found)[:limit]]


def _null_rows(chunks: IdChunks, limit: int, found: list[tuple[int, str]], column: str) -> tuple[int, int]:
    """Count null ids and add the first `limit`; the null count and the row count."""
    nulls = total = 0
    for chunk in _grouped(chunks()):
        if chunk.null_count:
            if nulls < limit:
                for row in pc.indices_nonzero(chunk.is_null()).to_numpy()[: limit - nulls]:
                    msg = f"row {total + row}: input.id_column {column!r} is null or missing; every row needs an id"
                    found.append((total + int(row), msg))
            nulls += chunk.null_count
        total += len(chunk)
    return nulls, total


def _grouped(chunks: Iterable[pa.Array], rows: int = 1 << 18) -> Iterable[pa.Array]:
    """Consecutive chunks as arrays of at least `rows` ids, dictionaries decoded: on chunks of a
    thousand ids Arrow's cost per call, not the ids, would take the time."""
    pending: list[pa.Array] = []
    count = 0
    for chunk in chunks:
        pending.append(_plain(chunk))
        count += len(chunk)
        if count >= rows:
            yield pending[0] if len(pending) == 1 else pa.concat_arrays(pending)
            pending, count = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else pa.concat_arrays(pending)


def _plain(chunk: pa.Array) -> pa.Array:
    """A dictionary-encoded chunk as its values; others as they are."""
    return chunk.dictionary_decode() if pa.types.is_dictionary(chunk.type) else chunk


def _with_hashes_in(chunks: IdChunks, repeated: Any) -> tuple[pa.Array, Any]:
    """The non-null ids whose hash is one of `repeated`, and their rows (ascending): every duplicate
    and its first row, and the rare id that only shares its hash."""
    import numpy as np

    values, rows = [], []
    offset = 0
    for chunk in _grouped(chunks()):
        hit = np.isin(_id_hashes(chunk), repeated)
        if chunk.null_count:
            hit &= chunk.is_valid().to_numpy(zero_copy_only=False)
        at = np.flatnonzero(hit)
        values.append(chunk.take(pa.array(at)))
        rows.append(at + offset)
        offset += len(chunk)
    return pa.concat_arrays(values), np.concatenate(rows)


def _id_hashes(chunk: pa.Array) -> Any:
    """A 64-bit hash of each id of a chunk (any value where null): equal ids, equal hashes, as Arrow
    compares them (0.0 and -0.0 alike). None for ids of other types (lists, structs)."""
    import numpy as np

    t, n = chunk.type, len(chunk)
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        bufs = chunk.buffers()
        kind = np.int64 if pa.types.is_large_string(t) or pa.types.is_large_binary(t) else np.int32
        offsets = np.frombuffer(bufs[1], kind)[chunk.offset : chunk.offset + n + 1].astype(np.int64)
        data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        return _bytes_hashes(offsets, data)
    if pa.types.is_floating(t):
        x = chunk.fill_null(0).to_numpy(zero_copy_only=False).astype(np.float64) + 0.0  # -0.0 becomes 0.0
        return splitmix64_array(x.view(np.uint64))
    if pa.types.is_boolean(t):
        return splitmix64_array(chunk.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint64))
    try:  # other fixed-width values (ints, dates, times, decimals, fixed-size binary) by their bytes
        width = t.bit_width // 8 if t.bit_width % 8 == 0 else 0
    except ValueError:  # lists, structs, ...
        return None
    if not width or t.num_fields or pa.types.is_interval(t) or len(chunk.buffers()) != 2:
        return None
    data = np.frombuffer(chunk.buffers()[1], np.uint8)[chunk.offset * width : (chunk.offset + n) * width]
    if width in (1, 2, 4, 8):
        return splitmix64_array(data.view(f"<u{width}").astype(np.uint64))
    return _matrix_hashes(data.reshape(n, width), np.full(n, width, np.int64))


def _bytes_hashes(offsets: Any, data: Any) -> Any:
    """Hashes of variable-length values given by Arrow offsets into data."""
    import numpy as np

    lengths = np.diff(offsets)
    n = len(lengths)
    longest = int(lengths.max()) if n else 0
    if n == 0 or longest == 0:
        return splitmix64_array(lengths.astype(np.uint64))
    if n * longest > 1 << 26 and n > 1:  # a few long ids: halves, so the padded copy stays small
        half = n // 2
        return np.concatenate([_bytes_hashes(offsets[: half + 1], data), _bytes_hashes(offsets[half:], data)])
    base = int(offsets[0])
    if (lengths == longest).all():
        matrix = data[base : base + n * longest].reshape(n, longest)
    else:
        matrix = np.zeros((n, longest), np.uint8)
        row = np.repeat(np.arange(n), lengths)
        matrix[row, np.arange(len(row)) - np.repeat(offsets[:-1] - base, lengths)] = data[base : int(offsets[-1])]
    return _matrix_hashes(matrix, lengths)


def _matrix_hashes(matrix: Any, lengths: Any) -> Any:
    """Hashes of the rows of an (ids, bytes) matrix, 8 bytes at a time, each row's length mixed in."""
    import numpy as np

    n, width = matrix.shape
    words = np.zeros((n, -(-width // 8) * 8), np.uint8)
    words[:, :width] = matrix
    words = words.view(np.uint64)
    h = lengths.astype(np.uint64)
    for j in range(words.shape[1]):
        # Only the words of each row's own bytes: a row's hash must not depend on the longest id beside
        # it, or equal ids in two chunks whose longest ids differ would hash apart and pass as unique.
        mixed = splitmix64_array(h ^ words[:, j])
        h = mixed if j == 0 else np.where(lengths > 8 * j, mixed, h)
    return h


def _duplicates(values: pa.Array, rows: Any, limit: int, found: list[tuple[int, str]]) -> int:
    """Count the ids that repeat an earlier row's (rows ascending with them), and add the first `limit`."""
    import numpy as np

    if len(values) < 2:
        return 0
    # A stable sort: equal ids stay in row order, so each run of them starts at its first row.
    order = pc.sort_indices(values)
    ordered = values.take(order)
    row = rows[order.to_numpy()]
    del order
    starts = np.ones(len(row), dtype=bool)
    same = pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1))
    starts[1:] = ~same.fill_null(False).to_numpy(zero_copy_only=False)
    repeats = np.flatnonzero(~starts)
    if len(repeats):
        first = np.maximum.accumulate(np.where(starts, np.arange(len(row)), 0))
        for i in repeats[np.argsort(row[repeats], kind="stable")[:limit]]:
            value = ordered[int(i)].as_py()
            msg = f"duplicate id {value!r} in rows {int(row[first[i]])} and {int(row[i])}; ids must be unique"
            found.append((int(row[i]), msg))
    return len(repeats)


def _id_problems_python(chunks: IdChunks, limit: int, found: list[tuple[int, str]]) -> int:
    """Duplicates of ids Arrow cannot sort (lists, structs), one row at a time, the first `limit` added."""
    count = 0
    seen: dict[Any, int] = {}
    row = 0
    for chunk in chunks():
        for value in chunk.to_pylist():
            if value is not None:
                key = value if isinstance(value, (str, int, float, bytes)) else repr(value)
                if key in seen:
                    count += 1
                    if count <= limit:
                        found.append((row, f"duplicate id {value!r} in rows {seen[key]} and {row}; ids must be unique"))
                else:
                    seen[key] = row
            row += 1
    return count


def check_ids(
    path: Any, ids: Union[pa.ChunkedArray, IdChunks], column: str = "id", hashed: Optional[IdHashes] = None
) -> None:
    """Ids must be present and unique; the error names the first bad row, its id and the row it repeats.
    hashed: their hashes, taken as they were written (`id_problems`)."""
    count, shown = id_problems(ids, column, limit=1, hashed=hashed)
    if count:
        raise InputError(f"{path}: {shown[0]}")


def check_id_type(path: Any, id_type: pa.DataType, ids: Union[pa.ChunkedArray, IdChunks], column: str) -> None:
    """Ids must be single values (strings, numbers, dates, ...): an id column of true/false values,
    objects or lists (or JSON text holding one) raises InputError naming the first such row. The ids
    are read only where their type (id_type) may hold such values."""
    chunks: IdChunks = (lambda: ids.chunks) if isinstance(ids, pa.ChunkedArray) else ids  # type: ignore[union-attr]
    if pa.types.is_floating(id_type):
        _refuse_non_finite(path, chunks(), column)
        return
    kind = _compound_kind(id_type)
    if kind is None and not isinstance(id_type, pa.BaseExtensionType):
        return
    row = 0
    for chunk in _grouped(chunks()):
        bad = chunk.is_valid() if kind else _json_compound(chunk)
        if pc.any(bad).as_py():
            at = pc.index(bad, True).as_py()
            value = chunk[at].as_py()
            shown = json.dumps(value) if not isinstance(value, str) else value
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise InputError(
                f"{path}: row {row + at}: input.id_column {column!r} is {kind or _JSON_KINDS[shown[:1]]} ({shown}); "
                "an id is one string or number: give every row such an id, or set input.id_column to another "
                "column (unset, rows are numbered)"
            )
        row += len(chunk)
    if kind is None:
        _refuse_mixed_json(path, chunks(), column)


def _refuse_non_finite(path: Any, chunks: Iterable[pa.Array], column: str) -> None:
    """InputError naming the first row whose float id is NaN or infinite: NaN equals no id, not even
    another NaN, so its duplicates would go unseen (and a JSON output cannot hold it)."""
    row = 0
    for chunk in _grouped(chunks):
        bad = pc.invert(pc.is_finite(chunk)).fill_null(False)
        if pc.any(bad).as_py():
            at = pc.index(bad, True).as_py()
            raise InputError(
                f"{path}: row {row + at}: input.id_column {column!r} is {chunk[at].as_py()}, not a finite number "
                "(NaN equals no id, not even itself, so duplicates would go unseen); give every row a finite "
                "number or a string as its id"
            )
        row += len(chunk)


def _refuse_mixed_json(path: Any, chunks: Iterable[pa.Array], column: str) -> None:
    """InputError where ids kept as JSON text (`datasets` keeps ints beside strings so) hold both numbers
    and strings: the output's id column holds one type, and writing a shard failed on every attempt."""
    first: dict[bool, tuple[int, str]] = {}  # is a string -> (row, JSON text) of the first such id
    row = 0
    for chunk in _grouped(chunks):
        storage = chunk.storage if isinstance(chunk, pa.ExtensionArray) else chunk
        if not (pa.types.is_string(storage.type) or pa.types.is_large_string(storage.type)):
            return
        lead = pc.utf8_slice_codeunits(pc.utf8_ltrim_whitespace(storage), 0, 1)
        for is_string, mask in ((True, pc.equal(lead, '"')), (False, pc.is_in(lead, value_set=_JSON_NUMBER_LEADS))):
            mask = mask.fill_null(False)
            if is_string not in first and pc.any(mask).as_py():
                at = pc.index(mask, True).as_py()
                first[is_string] = (row + at, storage[at].as_py())
        if len(first) == 2:
            (num_row, num), (str_row, text) = first[False], first[True]
            num = num.strip()
            raise InputError(
                f"{path}: row {num_row}: input.id_column {column!r} is the number {num} but row {str_row}'s is the "
                f"string {text}: an id column holds one type; write every id as a JSON string ("
                f'"{num}"), or every id as a number'
            )
        row += len(chunk)


_JSON_NUMBER_LEADS = pa.array(list("-0123456789NI"))

_JSON_KINDS = {"{": "an object", "[": "an array", "t": "true/false", "f": "true/false"}


def _compound_kind(t: pa.DataType) -> Any:
    """What an id of type t is where it is no single value, in JSON's words; else None."""
    if pa.types.is_dictionary(t):
        return _compound_kind(t.value_type)
    if pa.types.is_boolean(t):
        return "true/false"
    if pa.types.is_struct(t):
        return "an object"
    if pa.types.is_map(t):
        return "a map"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return "an array"
    return None


def _json_compound(chunk: pa.Array) -> pa.Array:
    """For ids kept as JSON text (ints beside strings): whether each is an object, array or bool."""
    storage = chunk.storage if isinstance(chunk, pa.ExtensionArray) else chunk
    if not (pa.types.is_string(storage.type) or pa.types.is_large_string(storage.type)):
        return pa.array([False] * len(chunk))
    first = pc.utf8_slice_codeunits(pc.utf8_ltrim_whitespace(storage), 0, 1)
    return pc.is_in(first, value_set=pa.array(list(_JSON_KINDS))).fill_null(False)
