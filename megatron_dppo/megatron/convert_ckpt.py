"""HF safetensors <-> Megatron-Core dist checkpoints (torch_dist), streamed; no GPTModel weights.

What a checkpoint must contain is taken from Megatron itself: the TP=1, PP=1 GPTModel is built on
the meta device (no memory) and its sharded_state_dict() gives every key, global shape, chunk
and ShardedObject the trainer's model will ask for. torch_dist stores global tensors in chunks,
so one checkpoint loads at any TP/PP (dist_checkpointing reshards on load). Megatron keys stack
the decoder layers on a leading axis: decoder.layers.mlp.linear_fc2.weight is [L, H, I] with one
chunk per layer, and the local spec's norms are saved under the TE names
(decoder.layers.self_attention.linear_qkv.layer_norm_weight, ...).

HF -> Megatron: write items are planned from that spec, cut into the chunks a TP=tp run would
save, and handed to torch.distributed.checkpoint's FileSystemWriter with a planner whose
resolve_data() builds each chunk only when the writer reaches it (qwen3.megatron_tensor_from_hf
reads just the HF tensors it needs). With one writer thread the writer resolves items one at a
time, in plan order, one .distcp file per decoder layer (or global tensor): memory is about one
megatron tensor plus its HF sources plus the layer being written.

Megatron -> HF: dist_checkpointing.load() with a partial sharded state dict (one decoder layer,
or one global tensor, at a time; the optimizer keys of a trainer checkpoint are never asked for),
qwen3.megatron_layer_to_hf, and hf_io.SafetensorsShardWriter, which writes each tensor straight
to its planned offset.

Megatron -> HF of a LoRA run (its checkpoint holds the adapters only, under their HF module names):
a PEFT adapter dir naming the base, or (--merge-lora) the base's HF dir with W + (alpha / r) B A
merged into each adapted weight, the base found where the run recorded it (or --base-dir) and
checked against the recorded weights fingerprint first: lora_to_hf.

On-disk layout of a converted checkpoint (the trainer's step_* dirs have the same first three):
    model_optim/          dist checkpoint (model keys only here; model + optimizer from the trainer)
    trainer_state.json    {"step": 0, "model_only": true, "source": {...}}
    hf_config.json        the HF config.json, verbatim (Megatron -> HF needs it)
    hf_assets/            tokenizer / generation config files of the HF dir, verbatim (optional)
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import queue
import re
import shutil
import time

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from megatron_dppo.config import model_layout_problems
from megatron_dppo.megatron.checkpoint import check_checkpoint, latest_checkpoint
from megatron_dppo.megatron.dcp_metadata import read_dcp_metadata
from megatron_dppo.megatron.lora import CHILD
from megatron_dppo.megatron.model import build_gpt_model, module_device
from megatron_dppo.model import qwen3
from megatron_dppo.model.arch import Arch
from megatron_dppo.model.hf_dir import check_hf_model_dir, check_weights
from megatron_dppo.model.hf_io import (
    HFCheckpoint,
    SafetensorsShardWriter,
    check_output_dir,
    copy_assets,
    staged_output_dir,
)
from megatron_dppo.model.peft_dir import (
    ADAPTER_WEIGHTS,
    check_adapter_tensors,
    hf_modules,
    split_factor_name,
    write_peft_adapter,
)
from megatron_dppo.model.qwen3 import load_hf_config  # noqa: F401  (the tools and tests import it from here)
from megatron_dppo.model.vocab import padded_vocab_size
from megatron_dppo.run.identity import weights_fingerprint

MODEL_DIR = "model_optim"
HF_CONFIG = "hf_config.json"
HF_ASSETS = "hf_assets"
TRAINER_STATE = "trainer_state.json"
EMBEDDING = "embedding.word_embeddings.weight"
_LAYER_KEY = "decoder.layers.self_attention.linear_qkv.weight"  # [L, ...]: tells the layer count
# Models with dense layers among MoE ones key each layer apart (Megatron's non-homogeneous layers).
_PER_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.weight$")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mib() -> float:
    return _status_mib("VmRSS")


def peak_rss_mib() -> float:
    """This process image's peak RSS (VmHWM). Not ru_maxrss: Linux carries that across fork +
    exec, so a converter started by a big parent would report the parent's peak."""
    return _status_mib("VmHWM")


# ---- the spec: what Megatron's GPTModel saves and loads ---------------------------------------
@contextlib.contextmanager
def spec_parallel_state():
    """Megatron's parallel state at TP=1, PP=1 for building the meta spec: set up (a 1-process
    world unless one exists) and torn down again, or reused when already at TP=1, PP=1."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dppo.megatron.parallel import destroy_parallel, initialize_parallel

    if parallel_state.model_parallel_is_initialized():
        if (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        ) != (1, 1):
            raise RuntimeError("checkpoint conversion needs TP=1, PP=1 parallel state: run it in its own process")
        yield
        return
    owns_world = not dist.is_initialized()
    initialize_parallel(1, 1)
    try:
        yield
    finally:
        destroy_parallel(world=owns_world)


def model_spec(hf_config, padded_vocab: int, dtype: torch.dtype):
    """[(megatron name, ShardedTensor)] and [ShardedObject] of the TP=1, PP=1 model, on the meta
    device, plus the meta model itself. Needs spec_parallel_state()."""
    with torch.device("meta"):
        # divisible_by=padded_vocab makes Megatron pad the vocab to exactly padded_vocab.
        model = build_gpt_model(
            hf_config, params_dtype=dtype, attention="local", make_vocab_size_divisible_by=padded_vocab
        )
    tensors, objects = [], []
    for name, item in model.sharded_state_dict().items():
        if isinstance(item, ShardedTensorFactory):  # SwiGLU fc1: a gate chunk and an up chunk
            built = item.build()
            tensors += [(name, t) for t in (built if isinstance(built, list) else [built])]
        elif isinstance(item, ShardedTensor):
            tensors.append((name, item))
        elif isinstance(item, ShardedObject):
            objects.append(item)
        else:
            raise TypeError(f"unexpected {type(item).__name__} at {name} in GPTModel.sharded_state_dict()")
    return model, tensors, objects


def _tp_chunks(name: str, st: ShardedTensor, tp: int):
    """(offsets, sizes) of the chunks a TP=tp run saves for this TP=1 ShardedTensor: Megatron
    splits a tensor-parallel weight along its partition axis; fc1's gate and up halves (separate
    ShardedTensors here) are each split the same way, so chunk layout = a real TP=tp save.
    Experts are one chunk each already (at any EP) and split over expert-TP, here 1."""
    p = st.prepend_axis_num
    off, size = list(st.global_offset), [1] * p + list(st.local_shape)
    tp = qwen3.split_group(name, tp, etp_size=1)[1]
    axis = {"vocab": 0, "column": 0, "fc1": 0, "row": 1}.get(qwen3.tp_split_kind(name))
    if axis is None or tp == 1:
        return [(off, size)]
    axis += p
    if size[axis] % tp:
        raise ValueError(f"{name}: dimension {size[axis]} does not split over tp={tp}")
    n = size[axis] // tp
    chunks = []
    for r in range(tp):
        o, s = list(off), list(size)
        o[axis] += r * n
        s[axis] = n
        chunks.append((o, s))
    return chunks


def _region(offsets, sizes, p: int):
    """Slices of a chunk inside its (per-layer) full tensor: the prepended layer axis dropped."""
    return tuple(slice(o, o + s) for o, s in zip(offsets[p:], sizes[p:]))


# ---- HF -> Megatron ---------------------------------------------------------------------------
class _StreamingSavePlanner(DefaultSavePlanner):
    """A save planner whose items are given, not derived from a state dict of tensors, and
    whose data is produced on demand by resolve(write_item)."""

    def __init__(self, items, resolve):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items, self._resolve = items, resolve

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item):
        return self._resolve(write_item)


class _Writer(FileSystemWriter):
    """torch's FileSystemWriter, with two changes:
    - one .distcp file per group of items (a decoder layer, or one global tensor) instead of one
      per rank: the writer keeps the last tensor of each key of a file alive until the file is
      closed, so per-file grouping keeps that to one layer (one file per rank kept the embedding
      chunk, one chunk per layer key and the output layer alive to the end);
    - .metadata records the path as a str, as Megatron's writer does: the trainer's restricted
      metadata unpickler (megatron/dcp_metadata.py) rejects the pathlib.Path torch puts there.
    write_data mirrors FileSystemWriter.write_data of torch 2.13 (it uses the private
    _write_data, which takes the same (path, file name, items) queue)."""

    def __init__(self, path: str, group_of):
        super().__init__(path, thread_count=1)
        self.group_of = group_of  # WriteItem -> a group label; files follow first appearance

    def write_data(self, plan, planner):
        groups = {}
        for item in plan.items:
            groups.setdefault(self.group_of(item), []).append(item)
        files = queue.Queue()
        for i, items in enumerate(groups.values()):
            name = f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, files)

    def storage_meta(self):
        meta = super().storage_meta()
        return dataclasses.replace(meta, checkpoint_id=str(meta.checkpoint_id)) if meta is not None else None


def check_layout_flags(tp: int, pp: int, ep: int = 1) -> None:
    """--tp / --pp / --ep of the conversion tools: positive integers (ValueError naming the flag)."""
    for flag, value in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} {value}: expected a positive integer (a parallel size)")


def check_model_layout(config_path: str, model: Arch, tp: int, pp: int, ep: int = 1) -> None:
    """The model against --tp / --pp / --ep: one ValueError naming the file, the flags and every
    count that does not divide (the trainer's rules, config.model_layout_problems, on the
    smallest world that holds the layout)."""
    check_layout_flags(tp, pp, ep)
    world = pp * math.lcm(tp, ep)
    problems = model_layout_problems(
        model, tp=tp, pp=pp, ep=ep, world_size=world, show=lambda flag, value: f"--{flag} {value}"
    )
    if problems:
        raise ValueError(f"{config_path}: --tp {tp} --pp {pp} --ep {ep} do not fit the model: " + "; ".join(problems))


def check_hf_source(hf_dir: str, tp: int, pp: int, ep: int = 1):
    """Everything that can be wrong with the input, before anything is built or written:
    the flags, files (config.json, index, shards), architecture, head / layer / expert counts vs
    TP / PP / EP, tensors. Returns (HFCheckpoint, hf_config, layout with the vocab padded for tp)."""
    check_layout_flags(tp, pp, ep)
    hf = HFCheckpoint(hf_dir)
    hf_config, _ = qwen3.read_model_config(hf.config_path)
    layout = qwen3.layout_from_hf_config(hf_config, padded_vocab=padded_vocab_size(hf_config.vocab_size, tp))
    check_model_layout(hf.config_path, Arch.from_hf_config(hf_config), tp, pp, ep)
    hf.check_has(qwen3.hf_tensor_names(layout))
    check_weights(hf, layout)  # shapes and a tied config's own lm_head, named as the trainer names them
    return hf, hf_config, layout


def hf_to_megatron_checkpoint(
    hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, dtype=None, log=print, ep: int = 1
) -> dict:
    """Write a Megatron dist checkpoint of the HF model in hf_dir, streamed. Returns a summary.
    All or nothing: written beside out_dir and renamed into place at the end (hf_io.staged_output_dir).
    The files do not depend on ep (each expert is a chunk of its own): ep is checked, and recorded.
    (One procedure, long on purpose: the tensors stream in file order through one writer, and the
    order of its steps is the memory bound; split into helpers it would hide that order.)"""
    hf, hf_config, layout = check_hf_source(hf_dir, tp, pp, ep)
    check_output_dir(out_dir)
    padded = layout.padded_vocab
    dtype = dtype or hf.dtype("model.embed_tokens.weight")
    with spec_parallel_state():
        _, tensors, objects = model_spec(hf_config, padded, dtype)

    items, where, blobs = [], {}, {}
    for name, st in tensors:
        for off, size in _tp_chunks(name, st, tp):
            chunk = ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size))
            items.append(
                WriteItem(
                    index=MetadataIndex(st.key, off),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk, properties=TensorProperties(dtype=dtype), size=torch.Size(st.global_shape)
                    ),
                )
            )
            where[(st.key, tuple(off))] = (name, st.prepend_axis_num, off, size)
    for obj in objects:  # _extra_state: Megatron saves torch.save([data]) per ShardedObject
        buf = io.BytesIO()
        torch.save([obj.data], buf)
        items.append(WriteItem(index=MetadataIndex(obj.unique_key), type=WriteItemType.BYTE_IO))
        blobs[obj.unique_key] = buf

    cache = {}  # the last full megatron tensor: its TP chunks are consecutive items

    def group_of(item):  # the decoder layer of a chunk, or its global tensor, or "objects"
        if item.type == WriteItemType.BYTE_IO:
            return "objects"
        name = where[(item.index.fqn, tuple(item.index.offset))][0]
        layer = qwen3.layer_index(name)
        return name if layer is None else layer

    def resolve(item):
        if item.type == WriteItemType.BYTE_IO:
            return blobs[item.index.fqn]
        name, p, off, size = where[(item.index.fqn, tuple(item.index.offset))]
        if name not in cache:
            cache.clear()
            cache[name] = qwen3.megatron_tensor_from_hf(name, hf.get, layout).to(dtype)
        return cache[name][_region(off, size, p)].reshape(size)

    rss0, t0 = rss_mib(), time.time()
    log(
        f"writing {len(items)} chunks of {len(tensors)} tensors to {out_dir} (tp={tp}, pp={pp}, ep={ep}, "
        f"vocab {layout.vocab} padded to {padded}, {dtype})"
    )
    with staged_output_dir(out_dir) as stage:
        os.makedirs(os.path.join(stage, MODEL_DIR))
        dcp.save(
            {},
            storage_writer=_Writer(os.path.join(stage, MODEL_DIR), group_of),
            planner=_StreamingSavePlanner(items, resolve),
            no_dist=True,
        )
        cache.clear()
        # What dist_checkpointing.save adds around the DCP files: the format config and the
        # (here empty) common state. Positional (backend, version) only: megatron-core 0.19
        # dropped the common_backend fields; its loader still reads a common.pt (as legacy).
        save_config(CheckpointingConfig("torch_dist", 1), os.path.join(stage, MODEL_DIR))
        torch.save({}, os.path.join(stage, MODEL_DIR, "common.pt"))
        shutil.copyfile(hf.config_path, os.path.join(stage, HF_CONFIG))
        assets = copy_assets(hf_dir, os.path.join(stage, HF_ASSETS))
        state = {
            "step": 0,
            "model_only": True,
            "source": {
                "hf_dir": os.path.abspath(hf_dir),
                "tp": tp,
                "pp": pp,
                "ep": ep,
                "padded_vocab": padded,
                "dtype": str(dtype).replace("torch.", ""),
            },
        }
        with open(os.path.join(stage, TRAINER_STATE), "w") as f:
            json.dump(state, f, indent=1)
    return {
        "seconds": time.time() - t0,
        "rss_before_mib": rss0,
        "peak_rss_mib": peak_rss_mib(),
        "weights_bytes": hf.total_bytes(),
        "assets": assets,
    }


# ---- Megatron -> HF ---------------------------------------------------------------------------
def resolve_checkpoint_dir(path: str) -> str:
    """A checkpoint dir (converted, or a trainer step_* dir), or a trainer root with `latest`."""
    if not os.path.isdir(os.path.join(path, MODEL_DIR)) and os.path.exists(os.path.join(path, "latest")):
        path = latest_checkpoint(path)
    if not os.path.isdir(os.path.join(path, MODEL_DIR)):
        raise FileNotFoundError(
            f"{path} has no {MODEL_DIR}/: expected a converted checkpoint, a trainer step_* "
            "directory, or a trainer checkpoint root with a `latest` file"
        )
    return path


def _checkpoint_layers(metadata: dict) -> int | None:
    """Decoder layers in a dist checkpoint: the stacked QKV key's first axis, or the per-layer
    keys' count (a model with dense layers among MoE ones); None when it has neither."""
    if _LAYER_KEY in metadata:
        return metadata[_LAYER_KEY].size[0]
    found = [int(m.group(1)) for k in metadata if (m := _PER_LAYER_KEY.match(k))]
    return max(found) + 1 if found else None


def _load_full(model_dir: str, entries) -> dict:
    """Load [(megatron name, TP=1 ShardedTensor)] -> {name: full (per-layer) tensor}."""
    # The layer axis is made an ordinary axis of size 1 (prepend_axis_num=0): Megatron loads
    # prepended-axis tensors through a torch ShardedTensor that must hold every chunk the process
    # owns, which one process asking for one layer does not; plain chunks load through DCP's
    # general path, any subset of them.
    request = {}
    for i, (_, st) in enumerate(entries):
        shape = (1,) * st.prepend_axis_num + tuple(st.local_shape)
        request[str(i)] = dataclasses.replace(
            st, data=torch.empty(shape, dtype=st.dtype), local_shape=shape, prepend_axis_num=0
        )
    # A partial request on purpose: the access check (every chunk loaded by some rank) must be off.
    loaded = dist_checkpointing.load(request, model_dir, validate_access_integrity=False)
    out = {}
    for i, (name, st) in enumerate(entries):
        p = st.prepend_axis_num
        t = loaded[str(i)].reshape(st.local_shape)
        full_shape = tuple(st.global_shape[p:])
        if tuple(t.shape) == full_shape:
            out[name] = t
        else:  # one of several chunks (fc1's gate / up halves)
            full = out.setdefault(name, torch.empty(full_shape, dtype=t.dtype))
            full[_region(st.global_offset, (1,) * p + tuple(st.local_shape), p)] = t
    return out


def megatron_to_hf_checkpoint(
    megatron_dir: str,
    out_dir: str,
    dtype=None,
    max_shard_bytes: int = 2 * 10**9,
    tokenizer_dir: str | None = None,
    log=print,
    merge_lora: bool = False,
    base_dir: str | None = None,
) -> dict:
    """Write HF safetensors shards + index + config (+ tokenizer files) of a Megatron checkpoint.
    All or nothing: written beside out_dir and renamed into place at the end (hf_io.staged_output_dir).
    A LoRA run's checkpoint (adapters only) becomes a PEFT adapter dir, or with merge_lora the base
    model (base_dir, else the one the run recorded) with the adapters merged: lora_to_hf.
    (Long for the same reason as hf_to_megatron_checkpoint: one streamed pass in file order.)"""
    ckpt = resolve_checkpoint_dir(megatron_dir)
    check_output_dir(out_dir)
    state = _trainer_state_if_readable(ckpt)
    if state.get("lora"):
        return lora_to_hf(ckpt, state, out_dir, merge_lora, base_dir, dtype, max_shard_bytes, tokenizer_dir, log)
    if merge_lora:
        check_checkpoint(ckpt)  # a missing or corrupt trainer state is named as such, not as "not LoRA"
        raise ValueError(
            f'--merge-lora: {ckpt} is not a LoRA run\'s checkpoint ({TRAINER_STATE} has no "lora" section): '
            "it holds the full model, which converts without --merge-lora"
        )
    model_dir = os.path.join(ckpt, MODEL_DIR)
    config_path = os.path.join(ckpt, HF_CONFIG)
    hf_config, _ = qwen3.read_model_config(config_path)
    check_checkpoint(ckpt)  # the trainer's check: every file there, whole (one line naming the file)
    md = read_dcp_metadata(model_dir)
    layers = _checkpoint_layers(md.state_dict_metadata)
    if EMBEDDING not in md.state_dict_metadata or layers is None:
        raise ValueError(f"{model_dir} holds no Megatron GPT model ({EMBEDDING} or {_LAYER_KEY} is missing)")
    emb = md.state_dict_metadata[EMBEDDING]
    padded, ckpt_dtype = emb.size[0], emb.properties.dtype
    if layers != hf_config.num_hidden_layers or emb.size[1] != hf_config.hidden_size or padded < hf_config.vocab_size:
        raise ValueError(
            f"{config_path} (num_hidden_layers={hf_config.num_hidden_layers}, hidden_size="
            f"{hf_config.hidden_size}, vocab_size={hf_config.vocab_size}) does not describe {model_dir} "
            f"({layers} layers, embedding {tuple(emb.size)})"
        )
    layout = qwen3.layout_from_hf_config(hf_config, padded_vocab=padded)
    out_dtype = dtype or ckpt_dtype
    with spec_parallel_state():  # dist_checkpointing.load needs the (1-process) world too
        model, tensors, _ = model_spec(hf_config, padded, ckpt_dtype)

        # Tensors are produced embedding first, then layer by layer, then the final norm and
        # lm_head (the order HF files have). Their names and shapes come from the mapping run on the
        # meta model, so the shard files are laid out before any weight is read.
        meta = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}.__getitem__
        sources = qwen3.global_hf_sources(layout)
        first, last = ["model.embed_tokens.weight"], [n for n in sources if n != "model.embed_tokens.weight"]
        planned = qwen3.megatron_globals_to_hf(meta, layout, first)
        for i in range(layout.num_layers):
            planned.update(qwen3.megatron_layer_to_hf(i, meta, layout))
        planned.update(qwen3.megatron_globals_to_hf(meta, layout, last))
        plan = [(n, tuple(t.shape), out_dtype) for n, t in planned.items()]
        # The spec's ShardedTensors grouped per load: a layer index, or a global megatron name.
        groups = {}
        for name, st in tensors:
            i = qwen3.layer_index(name)
            groups.setdefault(name if i is None else i, []).append((name, st))

        rss0, t0 = rss_mib(), time.time()
        log(
            f"reading {ckpt} ({layers} layers, vocab {layout.vocab} of {padded} padded, {ckpt_dtype}) -> "
            f"{out_dir} ({out_dtype})"
        )
        with staged_output_dir(out_dir) as stage:
            writer = SafetensorsShardWriter(stage, plan, max_shard_bytes)

            def emit(hf_tensors):
                for n, t in hf_tensors.items():
                    writer.write(n, t.to(out_dtype))

            def load(group):
                return _load_full(model_dir, groups[group]).__getitem__

            for hf_name in first:
                emit(qwen3.megatron_globals_to_hf(load(sources[hf_name]), layout, [hf_name]))
            for i in range(layout.num_layers):
                emit(qwen3.megatron_layer_to_hf(i, load(i), layout))
            for hf_name in last:
                emit(qwen3.megatron_globals_to_hf(load(sources[hf_name]), layout, [hf_name]))
            writer.close()
            _write_config(config_path, os.path.join(stage, "config.json"), out_dtype)
            assets_dir = os.path.join(ckpt, HF_ASSETS)
            src = assets_dir if os.path.isdir(assets_dir) else tokenizer_dir
            assets = copy_assets(src, stage) if src else []
    return {
        "seconds": time.time() - t0,
        "rss_before_mib": rss0,
        "peak_rss_mib": peak_rss_mib(),
        "weights_bytes": writer.total,
        "files": writer.files,
        "assets": assets,
        "checkpoint": ckpt,
    }


def _write_config(src: str, dst: str, dtype: torch.dtype) -> None:
    """config.json verbatim, unless its dtype field names another dtype than the weights have."""
    with open(src) as f:
        cfg = json.load(f)
    name = str(dtype).replace("torch.", "")
    key = "dtype" if "dtype" in cfg else "torch_dtype" if "torch_dtype" in cfg else None
    if key is None or cfg[key] == name:
        shutil.copyfile(src, dst)
        return
    cfg[key] = name
    with open(dst, "w") as f:
        json.dump(cfg, f, indent=2)


# ---- Megatron -> HF, LoRA ----------------------------------------------------------------------
# A LoRA run's checkpoint holds the adapters only (megatron/checkpoint.py), each under its global
# HF module name (lora_adapters.model.layers.0.self_attn.q_proj.lora_A, [r, in]; .lora_B, [out, r]);
# the base is the HF dir its trainer_state.json records under resume.model, path and fingerprint.
ADAPTER_PREFIX = CHILD + "."
_LORA_KEYS = ("rank", "alpha", "dropout", "targets")


def _trainer_state_if_readable(ckpt: str) -> dict:
    """trainer_state.json's object, or {} when it is missing or unreadable (check_checkpoint names
    that later, in the path that needs it)."""
    try:
        with open(os.path.join(ckpt, TRAINER_STATE)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _lora_section(state: dict, state_path: str) -> dict:
    lora = state["lora"]
    missing = [k for k in _LORA_KEYS if not isinstance(lora, dict) or k not in lora]
    if missing:
        raise ValueError(f"{state_path}: lora has no {missing[0]!r} key (expected {list(_LORA_KEYS)})")
    return lora


def lora_base_dir(ckpt: str, state: dict, base_dir: str | None, required: bool) -> tuple[str, str | None]:
    """(the base model's real path, a warning or None). The base is base_dir, else the recorded
    resume.model.hf_dir; when it exists its weights must have the recorded fingerprint
    (run/identity.weights_fingerprint): adapters merged onto, or named with, other weights are
    another model without a word. A missing base is an error when required (merging), else a
    warning (a PEFT dir only names it)."""
    state_path = os.path.join(ckpt, TRAINER_STATE)
    recorded = (state.get("resume") or {}).get("model") or {}
    recorded_dir, recorded_weights = recorded.get("hf_dir"), recorded.get("weights")
    base = base_dir or recorded_dir
    if not base:
        raise ValueError(f"{state_path} records no base model (resume.model.hf_dir): name it with --base-dir")
    if not os.path.isdir(base):
        if base_dir:
            raise FileNotFoundError(
                f"--base-dir {base_dir} is not a directory (expected the HF model the run trained its "
                f"adapters on; {state_path} records {recorded_dir})"
            )
        message = (
            f"the base model {recorded_dir} that {state_path} records does not exist any more: name its "
            "copy with --base-dir"
        )
        if required:
            raise FileNotFoundError(message)
        return recorded_dir, f"{message} (the adapter dir names the recorded path)"
    if not recorded_weights:
        raise ValueError(f"{state_path} records no base weights fingerprint (resume.model.weights) to check {base} by")
    found = weights_fingerprint(base)
    if found != recorded_weights:
        where = "--base-dir" if base_dir else "recorded"
        raise ValueError(
            f"base model {base} ({where}) has weights fingerprint {found}, but the adapters in {ckpt} were "
            f"trained on {recorded_dir} with fingerprint {recorded_weights} ({state_path} resume.model.weights): "
            "merged onto or named with other weights they are another model; give the run's base with --base-dir"
        )
    return os.path.realpath(base), None


def read_lora_adapters(model_dir: str) -> dict[str, torch.Tensor]:
    """Every adapter of a LoRA checkpoint, whole (over TP, PP, EP), under its HF name
    (model.layers.0.self_attn.q_proj.lora_A.weight). Needs spec_parallel_state()."""
    md = read_dcp_metadata(model_dir).state_dict_metadata
    keys = [k for k in md if k.startswith(ADAPTER_PREFIX) and k.endswith((".lora_A", ".lora_B"))]
    if not keys:
        raise ValueError(f"{model_dir} holds no LoRA adapters ({ADAPTER_PREFIX}* keys), yet {TRAINER_STATE} has lora")
    entries = [
        (k, ShardedTensor.from_rank_offsets(k, torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype)))
        for k in keys
    ]
    loaded = _load_full(model_dir, entries)
    return {k[len(ADAPTER_PREFIX) :] + ".weight": loaded[k] for k in keys}


def lora_to_hf(ckpt, state, out_dir, merge, base_dir, dtype, max_shard_bytes, tokenizer_dir, log) -> dict:
    """A LoRA checkpoint -> a PEFT adapter dir (out_dir: adapter_config.json + adapter_model.safetensors,
    plus CKPT/hf_assets/ or --tokenizer-dir's files when there are any), or with merge the base's
    HF dir with W + (alpha / rank) * B @ A in every adapted module's weight. Everything is checked
    (checkpoint files, lora section, base and its fingerprint, adapters against the targets) before
    out_dir is staged."""
    check_checkpoint(ckpt)
    lora = _lora_section(state, os.path.join(ckpt, TRAINER_STATE))
    base, warning = lora_base_dir(ckpt, state, base_dir, required=merge)
    base_hf = check_hf_model_dir(base, field="--base-dir" if base_dir else "resume.model.hf_dir") if merge else None
    rss0, t0 = rss_mib(), time.time()
    with spec_parallel_state():  # dist_checkpointing.load needs the (1-process) world
        adapters = read_lora_adapters(os.path.join(ckpt, MODEL_DIR))
    check_adapter_tensors(adapters, lora["rank"], hf_modules(lora["targets"]))
    assets_dir = os.path.join(ckpt, HF_ASSETS)
    assets_src = assets_dir if os.path.isdir(assets_dir) else tokenizer_dir
    if not merge:
        log(f"reading {ckpt} ({len(adapters) // 2} LoRA modules, rank {lora['rank']}) -> PEFT adapter dir {out_dir}")
        with staged_output_dir(out_dir) as stage:
            write_peft_adapter(
                stage,
                {n: t.to(dtype) if dtype else t for n, t in adapters.items()},
                rank=lora["rank"],
                alpha=lora["alpha"],
                dropout=lora["dropout"],
                target_modules=hf_modules(lora["targets"]),
                base_model=base,
            )
            assets = copy_assets(assets_src, stage) if assets_src else []
        info = {"files": [ADAPTER_WEIGHTS], "weights_bytes": sum(t.nbytes for t in adapters.values())}
    else:
        pairs = _adapter_pairs(adapters, base_hf)
        log(f"merging {len(pairs)} LoRA modules of {ckpt} into {base} -> {out_dir}")
        with staged_output_dir(out_dir) as stage:
            info = _write_merged(base_hf, pairs, lora["alpha"] / lora["rank"], stage, dtype, max_shard_bytes)
            if dtype is None:
                shutil.copyfile(base_hf.config_path, os.path.join(stage, "config.json"))
            else:
                _write_config(base_hf.config_path, os.path.join(stage, "config.json"), dtype)
            assets = copy_assets(assets_src or base, stage)
    return {
        **info,
        "kind": "merged" if merge else "peft",
        "seconds": time.time() - t0,
        "rss_before_mib": rss0,
        "peak_rss_mib": peak_rss_mib(),
        "assets": assets,
        "checkpoint": ckpt,
        "base": base,
        "lora_modules": len(adapters) // 2,
        "warning": warning,
    }


def _adapter_pairs(adapters: dict, base: HFCheckpoint) -> dict:
    """{HF module: {"A": lora_A, "B": lora_B}}, every module's weight checked to be in the base."""
    pairs = {}
    for name, t in adapters.items():
        module, factor = split_factor_name(name)
        pairs.setdefault(module, {})[factor] = t
    absent = sorted(m + ".weight" for m in pairs if m + ".weight" not in base.weight_map)
    if absent:
        raise ValueError(f"{base.source} lacks {len(absent)} weight(s) the adapters merge into, e.g. {absent[:3]}")
    return pairs


def _write_merged(base: HFCheckpoint, pairs: dict, scale: float, out: str, dtype, max_shard_bytes: int) -> dict:
    """The base's tensors in its files' order, one at a time, each adapted module's weight merged
    in fp32 (the adapters are small: all held)."""
    entries = base.tensors
    order = sorted(entries, key=lambda n: (entries[n].file, entries[n].offset))
    plan = [(n, entries[n].shape, dtype or entries[n].dtype) for n in order]
    writer = SafetensorsShardWriter(out, plan, max_shard_bytes)
    for name in order:
        tensor = base.get(name)
        pair = pairs.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if pair is not None:
            tensor = tensor.float() + (pair["B"].float() @ pair["A"].float()) * scale
        writer.write(name, tensor.to(dtype or entries[name].dtype))
    writer.close()
    return {"files": writer.files, "weights_bytes": writer.total}


# ---- verification -----------------------------------------------------------------------------
def prompt_ids(hf_dir: str, vocab: int, text: str, length: int = 24) -> torch.Tensor:
    """The prompt through the model's tokenizer when it has one, else fixed random ids."""
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(hf_dir).encode(text)
        if ids and max(ids) < vocab:
            return torch.tensor(ids, dtype=torch.long)
    except Exception:  # no (usable) tokenizer: the check does not depend on the text
        pass
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def megatron_logits(policy, tokens: torch.Tensor):
    """Full-vocab logits [s, vocab] of one sequence, on the CPU, on the last PP stage (None
    elsewhere). The tokens (on any device) go to the model's device; the logits come back."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    vocab = policy.hf_config.vocab_size
    device = module_device(policy.model)

    def step(data_iterator, model):
        toks = next(data_iterator)[None].to(device)
        out = model(input_ids=toks, position_ids=torch.arange(toks.shape[1], device=device)[None], attention_mask=None)

        def collect(logits):  # [1, s, padded/tp] -> all TP slices, padding cut
            full = gather_from_tensor_model_parallel_region(logits)[0, :, :vocab]
            return logits.sum() * 0.0, torch.ones((), dtype=torch.int, device=device), {"logits": full.float()}

        return out, collect

    policy.model.eval()
    out = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter([tokens]),
        model=[policy.model],
        num_microbatches=1,
        seq_length=len(tokens),
        micro_batch_size=1,
        forward_only=True,
    )
    return out[0]["logits"].cpu() if parallel_state.is_pipeline_last_stage() else None


def verify_logits(
    ckpt_dir: str, hf_dir: str, prompt: str = "The quick brown fox jumps over the lazy dog.", log=print
) -> float:
    """Collective (parallel state at the layout to check). Loads ckpt_dir with the trainer's
    load_checkpoint into a MegatronPolicy (fp32, on the GPU when there is one), runs a prompt
    through it and through the transformers model of hf_dir (fp32, on the CPU, on one rank),
    returns the max |logit difference| (the same on every rank)."""
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from megatron_dppo.config import AlgorithmConfig, OptimConfig
    from megatron_dppo.megatron.checkpoint import load_checkpoint
    from megatron_dppo.megatron.policy import MegatronPolicy
    from megatron_dppo.run.collectives import all_reduce_max

    ckpt = resolve_checkpoint_dir(ckpt_dir)
    hf_config = load_hf_config(os.path.join(ckpt, HF_CONFIG))
    policy = MegatronPolicy(hf_config, OptimConfig(), AlgorithmConfig(), params_dtype=torch.float32)
    load_checkpoint(ckpt, policy, load_optimizer=False)
    tokens = prompt_ids(hf_dir, hf_config.vocab_size, prompt)
    logits = megatron_logits(policy, tokens)
    diff = 0.0
    if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            expect = ref(tokens[None]).logits[0].float()
        diff = float((logits - expect).abs().max())
        ep = parallel_state.get_expert_model_parallel_world_size()
        ep = f"ep={ep}, " if ep > 1 else ""
        log(
            f"max |logit difference| megatron (tp={parallel_state.get_tensor_model_parallel_world_size()}, "
            f"pp={parallel_state.get_pipeline_model_parallel_world_size()}, {ep}{module_device(policy.model)}) vs "
            f"transformers (cpu) over {len(tokens)} tokens x {hf_config.vocab_size} vocab: {diff:.3e}"
        )
    return all_reduce_max([diff])[0]
