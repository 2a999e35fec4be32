"""HF safetensors -> this rank's shard of the Megatron policy, reading only what the rank owns.

Every rank reads only the tensors of its pipeline stage, and of each only its tensor-parallel
slice, with positioned reads (os.preadv) straight into a tensor of the slice's size: no rank
materialises the whole checkpoint, no shard is mmapped (mmapped pages would count as resident
until the file is closed). What a rank holds while loading is one megatron tensor's slice and
its HF sources (e.g. this rank's rows of q, k and v, then the fused linear_qkv slice).

Slices, per megatron tensor (model/qwen3.py has the layout rules):
  linear_qkv (column)  rank r owns KV groups [r*ng/tp, (r+1)*ng/tp): rows chunk r of q_proj,
                       of k_proj and of v_proj, fused with qwen3.fuse_qkv at ng/tp groups
  linear_fc1 (fc1)     rows chunk r of gate_proj and of up_proj, concatenated (gate, then up)
  linear_proj, fc2     columns chunk r of o_proj / down_proj (one read per row)
  embedding, output    rows [r*P/tp, (r+1)*P/tp) of the padded vocab P: the rows below the HF
                       vocab are read, the rest are zeros (Megatron's vocab padding)
  norms, MoE router    whole (replicated)
  experts (MoE)        only this expert-parallel rank's experts [r E/ep, (r+1) E/ep), each
                       split over the expert-tensor-parallel group as fc1 / fc2 are over TP;
                       the other ranks' experts are never read
With tied embeddings the last PP stage's output_layer.weight is read from model.embed_tokens.
The slices are fed to qwen3.megatron_tensor_from_hf with a per-rank layout (heads, KV groups
and padded vocab divided by tp), so whole-checkpoint conversion and this path share one table.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dppo.megatron.lora import base_parameters, is_adapter
from megatron_dppo.megatron.model import current_device
from megatron_dppo.model import qwen3 as mapping
from megatron_dppo.model.hf_dir import HFModelDirError, _fail, check_hf_model_dir
from megatron_dppo.model.hf_io import HFCheckpoint


# ---- positioned reads of slices -----------------------------------------------------------------
class SliceReader:
    """Reads rows [r0, r1) and columns [c0, c1) of an HF tensor into a tensor of exactly that size.
    Full-width rows are one contiguous read; a column slice is one read per row (only the needed
    bytes). Keeps its files open until close()."""

    def __init__(self, model_dir: HFCheckpoint):
        self.model_dir = model_dir
        self._fds = {}
        self.bytes_read = 0
        self.names_read = set()  # the HF tensors any part of which was read

    def _fd(self, file: str) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def _pread(self, fd, view, offset, file, name):
        while view:  # preadv may return less than asked for
            n = os.preadv(fd, [view], offset)
            if n <= 0:
                raise HFModelDirError(f"{file} is truncated (reading tensor {name!r} at byte {offset})")
            view, offset = view[n:], offset + n
            self.bytes_read += n

    def read(self, name: str, rows=None, cols=None) -> torch.Tensor:
        e = self.model_dir.tensors[name]
        self.names_read.add(name)
        r0, r1 = rows if rows is not None else (0, e.shape[0])
        full_width = cols is None or len(e.shape) < 2 or (cols[0] == 0 and cols[1] == e.shape[1])
        c0, c1 = (0, e.shape[1] if len(e.shape) > 1 else 1) if full_width else cols
        if not (0 <= r0 <= r1 <= e.shape[0]):
            raise ValueError(f"rows [{r0}, {r1}) outside {name} {list(e.shape)}")
        row_elems = torch.Size(e.shape[1:]).numel()
        out = torch.empty((r1 - r0, *e.shape[1:]) if full_width else (r1 - r0, c1 - c0), dtype=e.dtype)
        if out.numel() == 0:
            return out
        fd, item = self._fd(e.file), e.dtype.itemsize
        flat = memoryview(out.view(-1).view(torch.uint8).numpy())
        if full_width:
            self._pread(fd, flat, e.offset + r0 * row_elems * item, e.file, name)
            return out
        width = (c1 - c0) * item
        for i in range(r1 - r0):
            self._pread(
                fd, flat[i * width : (i + 1) * width], e.offset + ((r0 + i) * row_elems + c0) * item, e.file, name
            )
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}


def _chunk(n: int, rank: int, size: int, what: str):
    if n % size:
        raise ValueError(f"{what}: dimension {n} does not split over tp={size}")
    step = n // size
    return rank * step, (rank + 1) * step


def local_megatron_tensor(
    reader: SliceReader, layout: mapping.Qwen3Layout, name: str, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This TP rank's slice of the megatron tensor `name` (global name), read from its HF sources."""
    kind = mapping.tp_split_kind(name)
    source_name = name
    if layout.tied and name == "output_layer.weight":
        source_name = "embedding.word_embeddings.weight"  # a PP last stage's copy of the tied embedding

    def get(hf_name):
        shape = reader.model_dir.tensors[hf_name].shape
        if tp_size == 1 or kind == "replicated":
            rows = cols = None
        elif kind == "vocab":
            r0, r1 = _chunk(layout.padded_vocab, tp_rank, tp_size, name)
            rows, cols = (min(r0, shape[0]), min(r1, shape[0])), None
        elif kind == "row":
            rows, cols = None, _chunk(shape[1], tp_rank, tp_size, hf_name)
        else:  # column (whole KV groups: heads are stored group-major) and fc1 (gate, up alike)
            rows, cols = _chunk(shape[0], tp_rank, tp_size, hf_name), None
        return reader.read(hf_name, rows, cols)

    local = dataclasses.replace(
        layout,
        num_heads=layout.num_heads // tp_size,
        num_kv_heads=layout.num_kv_heads // tp_size,
        padded_vocab=layout.padded_vocab // tp_size,
    )
    return mapping.megatron_tensor_from_hf(source_name, get, local)


# ---- loading into models ---------------------------------------------------------------------------
def _check_same_model(model_dir: HFCheckpoint, layout: mapping.Qwen3Layout) -> None:
    theirs = model_dir.layout
    fields = ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "vocab", "tied")
    fields += ("num_experts", "moe_intermediate", "moe_layers")
    diff = [
        f"{f}={getattr(theirs, f)} (model: {getattr(layout, f)})"
        for f in fields
        if getattr(theirs, f) != getattr(layout, f)
    ]
    if diff:
        _fail(
            f"{os.path.join(model_dir.path, 'config.json')} does not describe the model being loaded: "
            + ", ".join(diff)
        )


def rank_layout() -> tuple:
    """(tp_rank, tp_size, pp_rank, pp_size) of this process (Megatron's parallel state)."""
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def expert_rank_layout() -> tuple:
    """(ep_rank, ep_size, expert_tp_rank, expert_tp_size) of this process."""
    return (
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    )


def load_hf_into_models(models, layout: mapping.Qwen3Layout, hf_dir) -> dict:
    """Copy this rank's slices of the HF checkpoint into each of `models` (GPTModels of the same
    stage, TP and EP rank, e.g. the policy and its reference). Not collective. Returns stats
    (tensors loaded, bytes read, the HF tensors read)."""
    model_dir = hf_dir if isinstance(hf_dir, HFCheckpoint) else check_hf_model_dir(hf_dir)
    _check_same_model(model_dir, layout)
    tp_rank, tp_size, pp_rank, pp_size = rank_layout()
    ep_rank, ep_size, etp_rank, etp_size = expert_rank_layout()
    params = [base_parameters(m) for m in models]  # LoRA's adapters are not in the HF files
    names = [k for k in models[0].state_dict() if not k.endswith("_extra_state") and not is_adapter(k)]
    for m, p in zip(models, params):
        extra = {k for k in m.state_dict() if not k.endswith("_extra_state") and not is_adapter(k)} ^ set(names)
        if extra or set(names) - p.keys():
            raise ValueError(f"models to load differ in their tensors: {sorted(extra or set(names) - p.keys())[:5]}")
    reader = SliceReader(model_dir)
    try:
        with torch.no_grad():
            for local in names:
                name = mapping.to_global_name(
                    local,
                    pp_rank,
                    pp_size,
                    layout.num_layers,
                    ep_rank=ep_rank,
                    ep_size=ep_size,
                    num_experts=layout.num_experts,
                )
                rank, size = mapping.split_group(name, tp_size, etp_size, tp_rank, etp_rank)
                t = local_megatron_tensor(reader, layout, name, rank, size)
                if t.shape != params[0][local].shape:
                    have = list(params[0][local].shape)
                    raise ValueError(
                        f"{model_dir.path}: {name} built from the checkpoint has shape "
                        f"{list(t.shape)}, this rank's parameter {local} has {have}"
                    )
                for p in params:
                    p[local].copy_(t)
                del t
    finally:
        reader.close()
    return {"tensors": len(names), "bytes_read": reader.bytes_read, "hf_tensors_read": reader.names_read}


def load_hf_into_policy(policy, hf_dir, into_reference: bool = True) -> dict:
    """Load the HF checkpoint in hf_dir (a path or a checked HFCheckpoint) into this rank's shard
    of policy (and of its KL reference, when it has one and into_reference). Each rank reads
    only its stage's tensors and its TP slice of each. Collective only in that every rank learns
    whether any rank failed (then all raise, instead of the others hanging in the next step)."""
    error = None
    try:
        models = [policy.model.module]
        if into_reference and policy.reference is not None:
            models.append(policy.reference)
        stats = load_hf_into_models(models, policy.layout, hf_dir)
        policy.optimizer.reload_model_params()  # the fp32 main copy of a bf16 model, if any
    except Exception as e:  # noqa: BLE001  (re-raised below, on every rank)
        error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        failed = torch.tensor([0 if error is None else 1], device=current_device())
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is None and failed.item():
            raise RuntimeError("loading the HF weights failed on another rank (its error says why)")
    if error is not None:
        raise error
    return stats
