"""Training data that need not fit in memory: samples read in batches into an Arrow file on the driver's disk,
memory-mapped (``Dataset``), and the columnar sources read in record batches (Parquet files, folders of them, Arrow
files and Hugging Face ``save_to_disk`` folders).

Memory: ``CacheWriter`` holds one batch (``BATCH`` samples) before it goes to the cache file; a Parquet file is
read a record batch at a time, of the prompt, answer and ``messages`` columns only. A step's ``step_batch`` takes
its rows from the memory-mapped cache: the pages those rows are on, not the file. The cache lives in a temporary
folder of the driver (the head pod's disk, ``TMPDIR``) and goes with the process.

Imports ``pyarrow`` (and ``numpy``), never torch.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
import pyarrow as pa
from pyarrow import ipc

#: The cache's columns: the prompt text, the answer (null: none), a chat sample's messages as JSON (null: a plain
#: prompt), and where the sample came from (its line or row, 1-based) for messages that name it.
SCHEMA = pa.schema([("prompt", pa.string()), ("answer", pa.string()), ("messages", pa.string()),
                    ("origin", pa.int64())])
BATCH = 8192
#: Leading bytes of a Parquet file.
PARQUET_MAGIC = b"PAR1"
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")


class DataError(ValueError):
    """A data source the run cannot use; the message names the source, the line or row, and what to change."""


@dataclass(frozen=True)
class Sample:
    """``prompt``: the text (for a chat sample the last user message's content, what reward hooks see);
    ``messages``: a chat sample's whole conversation as (role, content) pairs, None for a plain prompt."""

    prompt: str
    answer: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None


class Dataset(Sequence[Any]):
    """Samples (``algo.data.Sample``) in a memory-mapped Arrow table, optionally a subset (``index``: the rows
    kept, in order). ``unit`` is what ``origin`` counts (``line`` or ``row``)."""

    def __init__(self, table: pa.Table, unit: str = "line", index: np.ndarray | None = None,
                 keep_alive: Any = None) -> None:
        self.table, self.unit = table, unit
        self.index = index
        self._keep_alive = keep_alive  # the temporary folder (removed when the last view goes)

    def __len__(self) -> int:
        return self.table.num_rows if self.index is None else len(self.index)

    def _rows(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        if len(pos) and (pos.min() < 0 or pos.max() >= len(self)):
            raise IndexError(f"dataset index out of range (size {len(self)})")
        return pos if self.index is None else self.index[pos]

    def take(self, positions: Sequence[int] | np.ndarray) -> list[Any]:
        """The samples at ``positions`` (one gather from the cache)."""
        rows = self._rows(positions)
        if not len(rows):
            return []
        got = self.table.take(pa.array(rows)).to_pydict()
        out = []
        for prompt, answer, messages in zip(got["prompt"], got["answer"], got["messages"]):
            pairs = tuple((m[0], m[1]) for m in json.loads(messages)) if messages is not None else None
            out.append(Sample(prompt, answer, pairs))
        return out

    def origins(self, positions: Sequence[int] | np.ndarray) -> list[int]:
        """The line or row numbers (1-based) of the samples at ``positions``."""
        return self.table.column("origin").take(pa.array(self._rows(positions))).to_pylist()

    def subset(self, positions: Sequence[int] | np.ndarray) -> Dataset:
        """A view of the samples at ``positions`` (e.g. those a check kept)."""
        return Dataset(self.table, self.unit, self._rows(positions), self._keep_alive)

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return self.take(range(*i.indices(len(self))))
        if i < 0:
            i += len(self)
        return self.take([i])[0]

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, len(self), BATCH):
            yield from self.take(range(start, min(start + BATCH, len(self))))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, Dataset)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class CacheWriter:
    """Samples in, a memory-mapped ``Dataset`` out; at most ``BATCH`` samples in memory."""

    def __init__(self, unit: str = "line") -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="rlhf-data-")
        self.path = Path(self.tmp.name) / "samples.arrow"
        self.writer = ipc.new_file(str(self.path), SCHEMA)
        self.unit = unit
        self.pending: list[tuple[Any, int]] = []
        self.count = 0

    def add(self, sample: Any, origin: int) -> None:
        self.pending.append((sample, origin))
        self.count += 1
        if len(self.pending) >= BATCH:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        samples = [s for s, _ in self.pending]
        self.writer.write_batch(pa.record_batch([
            pa.array([s.prompt for s in samples], pa.string()),
            pa.array([s.answer for s in samples], pa.string()),
            pa.array([None if s.messages is None else json.dumps(s.messages) for s in samples], pa.string()),
            pa.array([o for _, o in self.pending], pa.int64()),
        ], schema=SCHEMA))
        self.pending = []

    def close(self) -> Dataset:
        self.flush()
        self.writer.close()
        table = ipc.open_file(pa.memory_map(str(self.path))).read_all()  # zero-copy: pages load when read
        return Dataset(table, self.unit, keep_alive=self.tmp)


# ------------------------------------------------------------------------------------------- columnar sources
def is_columnar(path: Path) -> bool:
    """A Parquet or Arrow file (by name or leading bytes), or a folder (Parquet files or ``save_to_disk``)."""
    if path.is_dir():
        return True
    if path.name.lower().endswith((".parquet", *ARROW_SUFFIXES)):
        return True
    try:
        with path.open("rb") as f:
            head = f.read(6)
    except OSError:
        return False
    return head.startswith((PARQUET_MAGIC, b"ARROW1"))


def _arrow_reader(path: Path) -> Any:
    """An Arrow IPC reader of ``path``: the file format (``.arrow`` written by pyarrow) or the stream format
    (Hugging Face ``save_to_disk``), memory-mapped."""
    source = pa.memory_map(str(path))
    try:
        return ipc.open_file(source)
    except pa.ArrowInvalid:
        source.seek(0)
        return ipc.open_stream(source)


def _files(path: Path, source: str) -> tuple[list[Path], str]:
    """The files of a columnar source and their kind (``parquet`` or ``arrow``)."""
    if not path.is_dir():
        return [path], ("arrow" if path.name.lower().endswith(ARROW_SUFFIXES) or _is_arrow(path) else "parquet")
    if (path / "dataset_dict.json").exists():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").exists())
        raise DataError(f"{source}: a Hugging Face DatasetDict (splits: {', '.join(splits) or 'none'}); point "
                        f"data.path at one split's folder, e.g. {path / (splits[0] if splits else 'train')}")
    state = path / "state.json"
    if state.exists():  # datasets.Dataset.save_to_disk: Arrow stream files listed in state.json
        try:
            files = [path / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{source}: state.json does not list the data files (_data_files): {e}") from None
        return files, "arrow"
    parquet = sorted(p for p in path.iterdir() if p.name.lower().endswith(".parquet"))
    if parquet:
        return parquet, "parquet"
    arrow = sorted(p for p in path.iterdir() if p.name.lower().endswith(ARROW_SUFFIXES))
    if arrow:
        return arrow, "arrow"
    names = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "empty"
    raise DataError(f"{source}: a folder without Parquet files, Arrow files or a Hugging Face save_to_disk "
                    f"state.json (it holds: {names}); point data.path at a prompts file or such a folder")


def _is_arrow(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(6) == b"ARROW1"
    except OSError:
        return False


def record_batches(path: Path, source: str, columns: Sequence[str]) -> Iterator[tuple[list[dict[str, Any]], int]]:
    """``(rows, first row number)`` of a columnar source, a record batch at a time, with only those of
    ``columns`` the data have (a ``DataError`` when it has none of ``columns[:2]``, the prompt and messages)."""
    import pyarrow.parquet as pq

    files, kind = _files(path, source)
    row = 1
    for f in files:
        where = f"{source}" + (f" ({f.name})" if f != path else "")
        try:
            if kind == "parquet":
                pf = pq.ParquetFile(str(f))
                names = pf.schema_arrow.names
            else:
                reader = _arrow_reader(f)
                names = reader.schema.names
        except FileNotFoundError:
            raise DataError(f"{where}: no such file") from None
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{where}: not a readable {'Parquet' if kind == 'parquet' else 'Arrow'} file: {e}"
                            ) from None
        cols = [c for c in columns if c in names]
        if not any(c in names for c in columns[:2]):
            raise DataError(f"{where}: no column {columns[0]!r} (data.promptField) and no 'messages' column; its "
                            f"columns: {', '.join(names[:16])}; set data.promptField to the prompt's column")
        if kind == "parquet":
            batches = pf.iter_batches(batch_size=BATCH, columns=cols)
        else:
            batches = (b.select(cols) for b in _iter_arrow(reader))
        for batch in batches:
            rows = batch.to_pylist()
            yield rows, row
            row += len(rows)


def _iter_arrow(reader: Any) -> Iterator[pa.RecordBatch]:
    if isinstance(reader, ipc.RecordBatchFileReader):
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    else:
        yield from reader
