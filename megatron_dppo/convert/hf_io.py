"""HF checkpoint files, read and written one tensor at a time (no megatron import).

Reading: HFCheckpoint reads one tensor's bytes with a plain positioned read into a fresh
tensor, using the shard's safetensors header. (safe_open would mmap the shard: the pages a
tensor touches then count as resident until the file is closed, doubling what a large tensor
costs.) Memory is bounded by the tensors in flight, not by the shards.

Writing: SafetensorsShardWriter is told every tensor's name, shape and dtype first (the
converter derives them on the meta device), fixes the shard files and byte offsets up front,
writes each header, and then writes each tensor straight to its offset (pwrite) as it is
produced, in any order: no shard is ever buffered. The files are ordinary safetensors
(contiguous data, 8-byte aligned header, {"format": "pt"} metadata) with the usual
model-0000i-of-0000n.safetensors names and a model.safetensors.index.json.
"""
from __future__ import annotations

import json
import os
import shutil
import struct

import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Files of an HF model directory that are neither weights nor config.json: tokenizer,
# generation config, chat template... They are carried along verbatim.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".onnx", ".distcp")

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def _read_header(path: str):
    """A safetensors file's header dict and the offset its data starts at."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


class HFCheckpoint:
    """An HF model directory: config.json plus model.safetensors or sharded safetensors + index."""

    def __init__(self, path: str):
        self.dir = path
        self._headers = {}
        self.config_path = os.path.join(path, "config.json")
        if not os.path.isfile(self.config_path):
            raise FileNotFoundError(f"{self.config_path} is missing: --hf-dir must be an HF model directory")
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                self.weight_map = json.load(f)["weight_map"]
            self.source = index
        elif os.path.isfile(os.path.join(path, SINGLE)):
            self.weight_map = {k: SINGLE for k in _read_header(os.path.join(path, SINGLE))[0] if k != "__metadata__"}
            self.source = os.path.join(path, SINGLE)
        else:
            raise FileNotFoundError(f"{path} has neither {INDEX} nor {SINGLE} (only safetensors checkpoints "
                                    "are read; convert .bin weights with transformers first)")
        missing = sorted({f for f in self.weight_map.values() if not os.path.isfile(os.path.join(path, f))})
        if missing:
            example = next(k for k, f in self.weight_map.items() if f == missing[0])
            raise FileNotFoundError(f"{self.source} names shard {missing[0]!r} (e.g. for {example!r}), which is "
                                    f"missing from {path}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))

    def _file(self, name: str) -> str:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} is not in {self.source}")
        return os.path.join(self.dir, self.weight_map[name])

    def check_has(self, names) -> None:
        absent = [n for n in names if n not in self.weight_map]
        if absent:
            raise KeyError(f"{self.source} lacks {len(absent)} tensor(s) the mapping needs, e.g. {absent[:3]}")

    def _entry(self, name: str):
        """(dtype, shape, absolute byte offset, byte length) from the shard's header (cached)."""
        path = self._file(name)
        if path not in self._headers:
            self._headers[path] = _read_header(path)
        header, base = self._headers[path]
        e = header[name]
        begin, end = e["data_offsets"]
        return _DTYPE_NAMES[e["dtype"]], tuple(e["shape"]), base + begin, end - begin

    def get(self, name: str) -> torch.Tensor:
        dtype, shape, offset, length = self._entry(name)
        out = torch.empty(shape, dtype=dtype)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        if len(view) != length:
            raise ValueError(f"{self._file(name)}: {name} has {length} bytes, its shape {shape} {dtype} needs {len(view)}")
        with open(self._file(name), "rb", buffering=0) as f:
            f.seek(offset)
            while view:  # readinto may return less than asked for
                n = f.readinto(view)
                if not n:
                    raise ValueError(f"{self._file(name)} is truncated (reading {name})")
                view = view[n:]
        return out

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[0]

    def total_bytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.dir, f)) for f in set(self.weight_map.values()))


def copy_assets(src_dir: str, dst_dir: str) -> list:
    """Copy the non-weight, non-config files (tokenizer, generation config, ...) of src_dir."""
    copied = []
    os.makedirs(dst_dir, exist_ok=True)
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        if (not os.path.isfile(path) or name in ("config.json", INDEX) or name.endswith(_WEIGHT_SUFFIXES)):
            continue
        shutil.copy2(path, os.path.join(dst_dir, name))
        copied.append(name)
    return copied


def parse_size(text: str) -> int:
    """'2GB', '500MB', '1GiB', '123' -> bytes."""
    t = text.strip().upper()
    for suffix, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6),
                         ("KB", 10**3), ("B", 1)):
        if t.endswith(suffix):
            return int(float(t[:-len(suffix)]) * mult)
    return int(t)


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
            for name, shape, dtype, nbytes in shard:
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
            os.close(fd)
        self.fds = []
        if self.pending:
            raise RuntimeError(f"{len(self.pending)} planned tensors were never written, e.g. {sorted(self.pending)[:3]}")
        weight_map = {name: self.files[fi] for name, (fi, *_rest) in self.where.items()}
        with open(os.path.join(self.out_dir, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
