"""HF checkpoint files, read and written one tensor at a time (no megatron import).

Reading: HFCheckpoint reads one tensor's bytes with a plain positioned read into a fresh
tensor, using the shard's safetensors header (safetensors_entries, checked against the file).
(safe_open would mmap the shard: the pages a
tensor touches then count as resident until the file is closed, doubling what a large tensor
costs.) Memory is bounded by the tensors in flight, not by the shards.

Writing: SafetensorsShardWriter is told every tensor's name, shape and dtype first (the
converter derives them on the meta device), fixes the shard files and byte offsets up front,
writes each header, and then writes each tensor straight to its offset (pwrite) as it is
produced, in any order: no shard is ever buffered. The files are ordinary safetensors
(contiguous data, 8-byte aligned header, {"format": "pt"} metadata) with the usual
model-0000i-of-0000n.safetensors names and a model.safetensors.index.json.

All or nothing: `staged_output_dir` gives a converter a temporary directory beside its output
and renames it into place only when the conversion finished, so a failed or killed conversion
never leaves a half-written model (a zero-filled shard, a partial model_optim/) where a user or
a retry would take it for a finished one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import os
import shutil
import socket
import struct

import torch

from megatron_dppo.model import qwen3

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files of an HF model directory that are neither weights nor config.json: tokenizer,
# generation config, chat template... They are carried along verbatim.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".onnx", ".distcp")

_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one HF tensor's bytes are: file, dtype, shape, absolute byte offset."""

    file: str
    dtype: torch.dtype
    shape: tuple
    offset: int

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def safetensors_entries(file: str) -> dict:
    """{name: TensorEntry} of one safetensors file from its header, checked against the file's size
    (every tensor's bytes inside it, as many as its shape and dtype need). The one reader of
    safetensors headers here: a ValueError naming the file (and tensor) for one that is not whole."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file} is truncated: {size} bytes, not even the 8-byte safetensors header length")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"{file} is truncated: {size} bytes, but its header alone says it is {8 + n} bytes long")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file}: the safetensors header is not valid JSON ({e}): the file is corrupt") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: the safetensors header is not a JSON object: the file is corrupt")
    base, parsed = 8 + n, []
    for name, e in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = _DTYPE_NAMES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"{file}: header entry of tensor {name!r} is not understood ({e!r}); dtypes read: "
                f"{sorted(_DTYPE_NAMES)}"
            ) from None
        need = torch.Size(shape).numel() * dtype.itemsize
        if end - begin != need:
            raise ValueError(
                f"{file}: tensor {name!r} has {end - begin} bytes in the header, its shape {list(shape)} "
                f"{e['dtype']} needs {need}"
            )
        parsed.append((begin, end, name, dtype, shape))
    parsed.sort()
    expected = base + max((end for _, end, *_ in parsed), default=0)
    for _begin, end, name, _dtype, _shape in parsed:  # in file order: name the first tensor cut short
        if base + end > size:
            raise ValueError(
                f"{file} is truncated: {size} bytes, but tensor {name!r} ends at byte {base + end} "
                f"(the header says the file is {expected} bytes long)"
            )
    return {name: TensorEntry(file, dtype, shape, base + begin) for begin, end, name, dtype, shape in parsed}


class HFCheckpoint:
    """An HF model directory: config.json plus model.safetensors, or sharded safetensors with an
    index; its tensors read one at a time. config: the model's transformers config when the caller
    has checked it already (model/hf_dir.check_hf_model_dir), else read from config.json on use."""

    def __init__(self, path: str, config=None):
        self.dir = self.path = path
        self._entries = {}  # file -> its safetensors_entries
        if config is not None:
            self.config = config
        self.config_path = os.path.join(path, "config.json")
        if not os.path.isfile(self.config_path):
            raise FileNotFoundError(f"{self.config_path} is missing: --hf-dir must be an HF model directory")
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f'{index}: expected JSON with a "weight_map" object ({type(e).__name__}: {e})'
                ) from None
            self.source = index
        elif os.path.isfile(os.path.join(path, SINGLE)):
            self.weight_map = dict.fromkeys(self._file_entries(os.path.join(path, SINGLE)), SINGLE)
            self.source = os.path.join(path, SINGLE)
        else:
            raise FileNotFoundError(
                f"{path} has neither {INDEX} nor {SINGLE} (only safetensors checkpoints "
                "are read; convert .bin weights with transformers first)"
            )
        missing = sorted({f for f in self.weight_map.values() if not os.path.isfile(os.path.join(path, f))})
        if missing:
            example = next(k for k, f in self.weight_map.items() if f == missing[0])
            raise FileNotFoundError(
                f"{self.source} names shard {missing[0]!r} (e.g. for {example!r}), which is "
                f"missing from {path}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )

    @functools.cached_property
    def config(self):
        return qwen3.read_model_config(self.config_path)[0]

    @property
    def layout(self):
        """The model's qwen3.Qwen3Layout (unpadded vocabulary)."""
        return qwen3.layout_from_hf_config(self.config)

    @functools.cached_property
    def tensors(self) -> dict:
        """{HF name: TensorEntry} of every tensor the weight map names (every shard's header read)."""
        return {name: self.entry(name) for name in self.weight_map}

    def _file(self, name: str) -> str:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in {self.source}")
        return os.path.join(self.dir, self.weight_map[name])

    def _file_entries(self, path: str) -> dict:
        if path not in self._entries:
            self._entries[path] = safetensors_entries(path)
        return self._entries[path]

    def entry(self, name: str) -> TensorEntry:
        """Where tensor `name` is, from its shard's header (read once)."""
        path = self._file(name)
        entries = self._file_entries(path)
        if name not in entries:
            raise ValueError(f"{self.source} maps tensor {name!r} to {path}, whose header does not have it")
        return entries[name]

    def check_has(self, names) -> None:
        """Every name is mapped to a shard whose header lists it with data inside the file
        (headers only: a truncated or foreign shard is named before any weight is read)."""
        absent = [n for n in names if n not in self.weight_map]
        if absent:
            raise KeyError(f"{self.source} lacks {len(absent)} tensor(s) the mapping needs, e.g. {absent[:3]}")
        for name in names:
            self.entry(name)

    def get(self, name: str) -> torch.Tensor:
        e = self.entry(name)
        out = torch.empty(e.shape, dtype=e.dtype)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        with open(e.file, "rb", buffering=0) as f:
            f.seek(e.offset)
            while view:  # readinto may return less than asked for
                n = f.readinto(view)
                if not n:
                    raise ValueError(f"{e.file} is truncated (reading {name})")
                view = view[n:]
        return out

    def dtype(self, name: str) -> torch.dtype:
        return self.entry(name).dtype

    def total_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.dir, f)) for f in set(self.weight_map.values()))


def copy_assets(src_dir: str, dst_dir: str) -> list:
    """Copy the non-weight, non-config files (tokenizer, generation config, ...) of src_dir."""
    copied = []
    os.makedirs(dst_dir, exist_ok=True)
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        if not os.path.isfile(path) or name in ("config.json", INDEX) or name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copy2(path, os.path.join(dst_dir, name))
        copied.append(name)
    return copied


# ---- all-or-nothing output directories ---------------------------------------------------------
def _staging_prefix(out_dir: str) -> str:
    parent, name = os.path.split(os.path.abspath(out_dir))
    return os.path.join(parent, f".{name}.partial-{socket.gethostname()}-")


def _remove_stale_staging(out_dir: str) -> list[str]:
    """Remove what killed conversions to out_dir left behind: staging dirs of this host whose
    process is gone (another host's, or a live process's, are left alone)."""
    removed = []
    prefix = _staging_prefix(out_dir)
    for path in glob.glob(glob.escape(prefix) + "*"):
        pid = path[len(prefix) :]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:  # alive, another user's
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def check_output_dir(out_dir: str) -> None:
    """A converter's output must not exist yet (an empty directory is fine): FileExistsError."""
    if os.path.lexists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        raise FileExistsError(
            f"{out_dir} already exists and is not an empty directory: choose a new --out-dir "
            "(conversions never write into existing output)"
        )


@contextlib.contextmanager
def staged_output_dir(out_dir: str):
    """Yields a new directory beside out_dir to write the whole output into; when the block
    finishes it is fsynced and renamed to out_dir (one rename: out_dir appears complete or not
    at all), when the block raises it is removed. A process killed inside the block leaves only
    `.<name>.partial-<host>-<pid>`, which the next conversion to out_dir removes."""
    check_output_dir(out_dir)
    _remove_stale_staging(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = _staging_prefix(out_dir) + str(os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        _fsync_tree(tmp)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty (checked above); fails, naming it, if something appeared since
        os.rename(tmp, out_dir)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """Data and directory entries on disk before the rename publishes them."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1GiB', '123' -> bytes; a ValueError naming the text otherwise."""
    t = text.strip().upper()
    for suffix, mult in (
        ("GIB", 2**30),
        ("MIB", 2**20),
        ("KIB", 2**10),
        ("GB", 10**9),
        ("MB", 10**6),
        ("KB", 10**3),
        ("B", 1),
        ("", 1),
    ):
        if t.endswith(suffix):
            try:
                value = int(float(t[: len(t) - len(suffix)]) * mult)
            except ValueError:
                break
            if value <= 0:
                break
            return value
    raise ValueError(f"size {text!r}: expected a positive byte count or a size like 500MB, 2GB, 1GiB")


class SafetensorsShardWriter:
    """Writes a planned set of tensors into safetensors shards, each tensor as it comes.

    plan: [(name, shape, dtype)] in the order tensors are expected (consecutive tensors share a
    shard, so a layer's tensors land in one file); a shard is closed once the next tensor would
    take it past max_shard_bytes (a larger tensor gets a shard of its own)."""

    def __init__(self, out_dir: str, plan, max_shard_bytes: int):
        self.out_dir = out_dir
        shards, current, size = [], [], 0
        for name, shape, dtype in plan:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if current and size + nbytes > max_shard_bytes:
                shards.append(current)
                current, size = [], 0
            current.append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        if current:
            shards.append(current)
        n = len(shards)
        self.files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.where = {}  # name -> (fd index, absolute offset, shape, dtype)
        self.fds = []
        self.total = 0
        for fi, (fname, shard) in enumerate(zip(self.files, shards)):
            header, off = {"__metadata__": {"format": "pt"}}, 0
            for name, shape, dtype, nbytes in shard:
                header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [off, off + nbytes]}
                off += nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
            base = 8 + len(raw)
            fd = os.open(os.path.join(out_dir, fname), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.write(fd, struct.pack("<Q", len(raw)) + raw)
            os.ftruncate(fd, base + off)
            self.fds.append(fd)
            self.total += off
            for name, shape, dtype, _nbytes in shard:
                self.where[name] = (fi, base + header[name]["data_offsets"][0], shape, dtype)
        self.pending = set(self.where)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.pending:
            raise KeyError(f"{name!r} was not planned or was already written")
        fi, off, shape, dtype = self.where[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{name}: planned {shape} {dtype}, got {tuple(tensor.shape)} {tensor.dtype}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        view = memoryview(data)
        while view:  # pwrite may write less than asked for
            n = os.pwrite(self.fds[fi], view, off)
            view, off = view[n:], off + n
        self.pending.discard(name)

    def close(self) -> None:
        for fd in self.fds:
            os.fsync(fd)
            os.close(fd)
        self.fds = []
        if self.pending:
            raise RuntimeError(
                f"{len(self.pending)} planned tensors were never written, e.g. {sorted(self.pending)[:3]}"
            )
        weight_map = {name: self.files[fi] for name, (fi, *_rest) in self.where.items()}
        with open(os.path.join(self.out_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
