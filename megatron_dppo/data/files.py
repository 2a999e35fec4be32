"""Reading prompt files: rows as Python dicts, each with where it came from.

Accepted (local paths only; nothing is fetched from a hub):
  FILE.jsonl    one JSON object per line; blank lines are skipped; location "line N"
  FILE.parquet  one row per record (verl's format); location "row N"
  DIR/          a dataset saved with the `datasets` library's `save_to_disk`: a Dataset dir
                (state.json + data-*.arrow), or a DatasetDict dir (dataset_dict.json + one dir
                per split) when it has exactly one split; location "row N"

Dataset dirs are read with pyarrow alone, the way `datasets.Dataset.load_from_disk` reads them:
state.json lists the shard files (`_data_files`) in order, and each shard is an Arrow IPC stream
(datasets/table.py opens them with pa.ipc.open_stream). pyarrow is already a dependency; the
`datasets` package would add pandas, huggingface_hub and a hub client to every reward worker
and start-up for a 20-line read of a format that has not changed since datasets 1.x. The tests
write their dirs with the real `datasets.save_to_disk` (a dev dependency), so a format change
there fails a test instead of a user's run.
"""

from __future__ import annotations

import json
import os

DATASET_STATE = "state.json"  # datasets.config.DATASET_STATE_JSON_FILENAME
DATASET_DICT = "dataset_dict.json"  # datasets.config.DATASETDICT_JSON_FILENAME
SUFFIXES = (".jsonl", ".parquet")


def data_paths(spec) -> list[str]:
    """data.train's value -> its paths: a list of paths, or one string of comma-separated paths
    ("a.jsonl,b.parquet"; a path with a comma in its name needs the list form)."""
    items = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    paths = [str(p).strip() for p in items if str(p).strip()]
    if not paths:
        raise ValueError(f"no prompt file given (got {spec!r})")
    return paths


def read_rows(path: str):
    """Yield (location, row dict | JSON error) in file order; location is 'line N' or 'row N'."""
    if os.path.isdir(path):
        yield from _dataset_dir_rows(path)
        return
    ext = os.path.splitext(path)[1].lower()
    if ext not in SUFFIXES:
        raise ValueError(
            f"{path}: unsupported prompt file type {ext!r} (use .jsonl, .parquet, or a directory "
            "written by datasets' save_to_disk)"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: prompt file not found")
    yield from (_parquet_rows(path) if ext == ".parquet" else _jsonl_rows(path))


def _jsonl_rows(path: str):
    with open(path, "rb") as f:
        for i, raw_line in enumerate(f, 1):
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:line {i}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue  # blank lines (a trailing newline) are not records
            try:
                yield f"line {i}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"line {i}", e


def _parquet_rows(path: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: cannot read as Parquet: {e}") from None
    yield from _table_rows(table)


def _table_rows(table):
    i = 0
    for batch in table.to_batches():
        for row in batch.to_pylist():
            i += 1
            yield f"row {i}", row


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _dataset_dir_rows(path: str):
    if os.path.isfile(os.path.join(path, DATASET_DICT)):
        splits = _read_json(os.path.join(path, DATASET_DICT)).get("splits")
        if not isinstance(splits, list) or not splits:
            raise ValueError(f"{os.path.join(path, DATASET_DICT)}: no 'splits' list")
        if len(splits) != 1:
            raise ValueError(
                f"{path}: a datasets DatasetDict with splits {splits}: point at one split's directory, "
                f"e.g. {os.path.join(path, str(splits[0]))}"
            )
        path = os.path.join(path, str(splits[0]))
    state_path = os.path.join(path, DATASET_STATE)
    if not os.path.isfile(state_path):
        raise ValueError(
            f"{path}: a directory, but not a dataset saved with datasets' save_to_disk (no {DATASET_STATE} "
            f"or {DATASET_DICT}); prompt data is a .jsonl or .parquet file or such a directory"
        )
    files = _read_json(state_path).get("_data_files")
    if not isinstance(files, list) or not files or not all(isinstance(f, dict) and "filename" in f for f in files):
        raise ValueError(f"{state_path}: no '_data_files' list of {{filename}} entries")
    import pyarrow as pa

    tables = []
    for entry in files:
        shard = os.path.join(path, entry["filename"])
        try:
            tables.append(pa.ipc.open_stream(pa.memory_map(shard)).read_all())  # as datasets/table.py does
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{shard}: cannot read as an Arrow stream (a datasets shard): {e}") from None
    yield from _table_rows(pa.concat_tables(tables) if len(tables) > 1 else tables[0])
