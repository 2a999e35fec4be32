"""The policy's weights under HF names: loaded from HF tensors, exported (TP-merged, gathered from
every PP stage) one unit at a time for the weight sync into vLLM and for HF checkpoints, and the
DP-reduced gradients under HF names (the layout tests compare them with a reference).

A "unit" is the embedding, one decoder layer, or the head (final norm + output layer): streaming
by unit keeps a large model's export from ever holding the whole model on one rank.

Mixture-of-experts layers: an expert is split over the expert-tensor-parallel group (never over
TP) and lives on one expert-parallel rank (rank r's local expert e is global expert r E/ep + e),
so the export merges it over expert-TP and all-gathers it over EP: every rank, and so every vLLM
engine, gets all experts of the unit, under per-expert HF names (mlp.experts.E.*_proj), which
vLLM's Qwen3-MoE loader reads. The router and the norms are replicated. Gradients: the DDP
reduces the experts' over the expert-data-parallel group (expert_parallel_buffers).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from megatron_dppo.megatron.hf_load import expert_rank_layout, rank_layout
from megatron_dppo.megatron.lora import base_parameters, is_adapter
from megatron_dppo.megatron.model import current_device
from megatron_dppo.model import qwen3 as mapping


@dataclass(frozen=True)
class _Ranks:
    """This rank's place in the dense layout (TP x DP x PP) and the expert one (expert-TP x EP x
    expert-DP x PP, over the same world and the same pipeline stages)."""

    tp_size: int
    pp_size: int
    pp_rank: int
    ep_size: int
    ep_rank: int
    etp_size: int

    @classmethod
    def current(cls) -> _Ranks:
        _, tp_size, pp_rank, pp_size = rank_layout()
        ep_rank, ep_size, _, etp_size = expert_rank_layout()
        return cls(tp_size, pp_size, pp_rank, ep_size, ep_rank, etp_size)

    def global_name(self, local: str, layout, ep_rank: int | None = None) -> str:
        """A local name's global one; an expert's as EP rank ep_rank (default: this rank) numbers it."""
        return mapping.to_global_name(
            local,
            self.pp_rank,
            self.pp_size,
            layout.num_layers,
            ep_rank=self.ep_rank if ep_rank is None else ep_rank,
            ep_size=self.ep_size,
            num_experts=layout.num_experts,
        )


def _merged_shape(name: str, shape, split_size: int) -> tuple:
    """The full shape of a tensor split split_size ways (TP, or expert-TP for an expert)."""
    kind = mapping.tp_split_kind(name)
    shape = list(shape)
    if split_size > 1 and kind != "replicated":
        shape[1 if kind == "row" else 0] *= split_size
    return tuple(shape)


def _unit_of(name: str):
    """A decoder layer's index, or 'embedding' / 'head' for the rest."""
    if name.startswith("decoder.layers."):
        return int(name.split(".")[2])
    return "embedding" if name.startswith("embedding.") else "head"


def _unit_order(unit):
    """Decoder layers, the head, then the embedding: a consumer holds the last tensor it was given
    while it asks for the next (vLLM's loaders keep their loop variables), so a unit ends with a
    norm (_norm_last) and the one-tensor embedding unit comes last, when nothing is gathered after it."""
    return 10**9 + 1 if unit == "embedding" else (10**9 if unit == "head" else unit)


def _norm_last(hf: dict) -> list:
    """A unit's (HF name, tensor) pairs with its smallest layer-level norm (a vLLM module of its own,
    so the order is still by parent module) last: see _unit_order."""
    items = list(hf.items())
    norms = [i for i, (k, _) in enumerate(items) if k.endswith(("layernorm.weight", "model.norm.weight"))]
    if norms:
        items.append(items.pop(min(norms, key=lambda i: items[i][1].numel())))
    return items


def load_hf_state_dict(modules: list, layout, hf_sd: dict) -> None:
    """Copy HF-named full tensors (every rank passes the same dict) into this rank's shard of each
    module (its TP slices, and only its EP rank's experts, split over expert-TP). Holds the whole
    model on every rank: for small models and tests. From an HF directory,
    megatron_dppo.megatron.hf_load reads only this rank's slices."""
    ep_rank, ep_size, etp_rank, etp_size = expert_rank_layout()
    local = mapping.shard_for_rank(
        mapping.hf_to_megatron(hf_sd, layout),
        layout,
        *rank_layout(),
        ep_rank=ep_rank,
        ep_size=ep_size,
        etp_rank=etp_rank,
        etp_size=etp_size,
    )
    for module in modules:
        own = {k for k in module.state_dict() if not k.endswith("_extra_state") and not is_adapter(k)}
        missing, unexpected = own - local.keys(), local.keys() - own
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        with torch.no_grad():
            params = base_parameters(module)
            for name, tensor in local.items():
                params[name].copy_(tensor)


def non_finite(module: torch.nn.Module, layout, grads: bool = False) -> list[str]:
    """Global megatron names of this rank's parameters (or, with grads, their main_grad) holding
    a NaN or an infinity (an expert by its global number)."""
    ranks = _Ranks.current()
    out = []
    for name, p in module.named_parameters():
        t = getattr(p, "main_grad", None) if grads else p
        if t is not None and not bool(torch.isfinite(t).all()):  # an adapter's key holds its global layer
            out.append(name if is_adapter(name) else ranks.global_name(name, layout))
    return out


def copy_parameters(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """dst := src, shard by shard (both built with the same TP/PP layout: no communication)."""
    a, b = base_parameters(src), base_parameters(dst)
    if a.keys() != b.keys():
        raise ValueError(f"the two models differ in their parameters: {sorted(a.keys() ^ b.keys())[:5]}")
    with torch.no_grad():
        for name, p in b.items():
            p.copy_(a[name])


def _produced(local: str, t: torch.Tensor, ranks: _Ranks, layout) -> list:
    """(global name, full shape, dtype) of what this rank's stage makes of one local tensor: one
    entry, or for an expert one per EP rank (every EP rank holds the same local names)."""
    shape = _merged_shape(local, t.shape, mapping.split_group(local, ranks.tp_size, ranks.etp_size)[1])
    if not mapping.is_expert(local):
        return [(ranks.global_name(local, layout), shape, t.dtype)]
    return [(ranks.global_name(local, layout, ep_rank=r), shape, t.dtype) for r in range(ranks.ep_size)]


def _stage_metadata(produced: list, ranks: _Ranks) -> dict:
    """{global name: (stage, its global rank, full shape, dtype)} of every PP stage's tensors."""
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    meta = {}
    for stage, src in enumerate(dist.get_process_group_ranks(pp_group)):
        info = [produced if stage == ranks.pp_rank else None]
        if ranks.pp_size > 1:
            dist.broadcast_object_list(info, src=src, group=pp_group)
        for k, shape, dtype in info[0]:
            meta[k] = (stage, src, shape, dtype)
    return meta


# torch >= 2.13's name for all_gather_into_tensor (which it deprecates)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gathered(t: torch.Tensor, size: int, group) -> torch.Tensor:
    """[size, *t.shape]: every rank's t over `group`, gathered straight into one buffer (a list
    of outputs would take a flat copy of them all inside the collective: twice the memory)."""
    out = torch.empty((size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    _all_gather_single(out, t.contiguous(), group=group)
    return out.view(size, *t.shape)


def _merge_split(name: str, t: torch.Tensor, size: int, group) -> torch.Tensor:
    """The full tensor from its `size` slices over `group` (TP, or expert-TP for an expert). A
    vocab / column split is the slices' concatenation along dim 0: the gather buffer itself; a
    row / fc1 split takes one more copy (tp_merge) while the buffer is alive."""
    kind = mapping.tp_split_kind(name)
    if size == 1 or kind == "replicated":
        return t
    shards = _gathered(t, size, group)
    if kind in ("vocab", "column"):
        return shards.view(size * t.shape[0], *t.shape[1:])
    return mapping.tp_merge(name, list(shards.unbind(0)))


def _gather_experts(linear: str, parts: list, ranks: _Ranks) -> list:
    """One linear of one layer's local experts (expert order) -> [EP rank][local expert] full
    tensors: one collective over expert-TP and one over EP for all the layer's experts of that
    linear (not one per expert: ~25k calls a sync at Qwen3-30B-A3B), on the experts stacked."""
    ps = parallel_state
    if ranks.etp_size > 1:
        shards = _gathered(torch.stack(parts), ranks.etp_size, ps.get_expert_tensor_parallel_group())
        parts = [mapping.tp_merge(linear, list(shards[:, e].unbind(0))) for e in range(len(parts))]
        del shards
    if ranks.ep_size == 1:
        return [parts]
    stacked = torch.stack(parts)
    del parts
    full = _gathered(stacked, ranks.ep_size, ps.get_expert_model_parallel_group())
    del stacked
    return [list(full[r].unbind(0)) for r in range(ranks.ep_size)]


def _stage_unit(names: list, tensors: dict, ranks: _Ranks, layout) -> dict:
    """{global name: full tensor} of one unit of this rank's stage: dense tensors merged over TP,
    experts merged over expert-TP (never over TP) and all-gathered over EP (rank r's local
    expert e is global expert r E/ep + e). Collective over the TP, expert-TP and EP groups, whose
    ranks all hold the same local names: they iterate them in the same (sorted) order."""
    out, experts = {}, {}
    for local in sorted(names):
        if mapping.is_expert(local):  # grouped by layer and linear: local expert 0's name is the key
            experts.setdefault(mapping.with_expert_index(local, 0), []).append(local)
            continue
        group = parallel_state.get_tensor_model_parallel_group()
        out[ranks.global_name(local, layout)] = _merge_split(local, tensors[local], ranks.tp_size, group)
    for linear in sorted(experts):
        names_e = sorted(experts[linear], key=mapping.expert_index)
        for r, full in enumerate(_gather_experts(linear, [tensors[n] for n in names_e], ranks)):
            for local, t in zip(names_e, full):
                out[ranks.global_name(local, layout, ep_rank=r)] = t
    return out


def _units(tensors: dict, layout):
    """Every PP stage's units, in order, on every rank: yields (unit, bytes of its full tensors,
    fetch), fetch() -> {global megatron name: full tensor}, collective over the world: every
    rank calls it for every unit, in order. The sizes come from the stages' metadata, before any
    tensor is gathered (hf_weight_buckets closes a bucket on them)."""
    ranks = _Ranks.current()
    if layout.tied and ranks.pp_size > 1:  # the last stage's copy of the tied embedding
        tensors = {k: t for k, t in tensors.items() if k != "output_layer.weight"}
    meta = _stage_metadata([p for k, t in tensors.items() for p in _produced(k, t, ranks, layout)], ranks)
    units, mine = {}, {}
    for k in meta:
        units.setdefault(_unit_of(k), []).append(k)
    for local in tensors:
        mine.setdefault(_unit_of(ranks.global_name(local, layout)), []).append(local)
    pp_group = parallel_state.get_pipeline_model_parallel_group()

    def fetch(unit) -> dict:
        own = _stage_unit(mine.get(unit, []), tensors, ranks, layout)
        out = {}
        for k in sorted(units[unit]):
            stage, src, shape, dtype = meta[k]
            if stage == ranks.pp_rank:
                buf = own.pop(k).contiguous()
            else:
                buf = torch.empty(shape, dtype=dtype, device=current_device())
            if ranks.pp_size > 1:
                dist.broadcast(buf, src=src, group=pp_group)
            out[k] = buf
        return out

    for unit in sorted(units, key=_unit_order):
        nbytes = sum(math.prod(meta[k][2]) * meta[k][3].itemsize for k in units[unit])
        yield unit, nbytes, lambda unit=unit: fetch(unit)


def full_units(tensors: dict, layout):
    """Local megatron-named tensors -> full tensors (TP- and expert-TP-merged, every EP rank's
    experts) of every PP stage, on every rank, one unit at a time. Yields (unit, {global megatron
    name: full tensor}); a unit's tensors are let go before the next is gathered. Collective
    over the world."""
    for unit, _, fetch in _units(tensors, layout):
        out = fetch()
        yield unit, out
        del out


def unit_to_hf(unit, full: dict, layout) -> dict:
    """One unit's full megatron-named tensors -> HF names (vocab padding cut off)."""
    if isinstance(unit, int):
        return mapping.megatron_layer_to_hf(unit, full.__getitem__, layout)
    out = {}
    if "embedding.word_embeddings.weight" in full:
        out["model.embed_tokens.weight"] = full["embedding.word_embeddings.weight"][: layout.vocab]
    if "decoder.final_layernorm.weight" in full:
        out["model.norm.weight"] = full["decoder.final_layernorm.weight"]
    if "output_layer.weight" in full:
        out["lm_head.weight"] = full["output_layer.weight"][: layout.vocab]
    return out


def hf_weight_buckets(module: torch.nn.Module, layout, bucket_bytes: int = 1 << 30):
    """The module's current weights under HF names, in buckets, on every rank. A generator: the
    weight sync streams a large model instead of gathering it whole.

    A bucket is the HF tensors of whole units, closed before the next unit would take it past
    bucket_bytes (a larger unit is a bucket of its own), on the stages' metadata, so every rank
    closes the same buckets. A unit's full tensors are let go as it is converted, and a bucket
    when the caller asks for the next: a caller that drops each bucket (and tensor) as it
    consumes it (RolloutEngine.load_weights) holds at most max(bucket_bytes, the largest unit)
    of them, plus one tensor's merge copy, at any time (plan.sync_peak_bytes)."""
    local = {k: v.detach() for k, v in base_parameters(module).items()}
    bucket, size = [], 0
    for unit, nbytes, fetch in _units(local, layout):
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += _norm_last(unit_to_hf(unit, fetch(), layout))
        size += nbytes
    if bucket:
        yield bucket


def _reduced_main_grads(ddp) -> dict:
    """{local megatron name: this rank's DP-reduced gradient} after forward_backward, copies.

    Without the distributed optimizer the DDP all-reduces every bucket: main_grad is the reduced
    gradient. With it (on by default on GPUs) the DDP reduce-scatters instead: each bucket's
    grad_data is cut into dp equal shards and rank r holds the reduced sum only in shard r; the
    rest of its main_grad is still its own unreduced gradient. Here each bucket's reduced shards
    are all-gathered (into a copy of the buffer: the optimizer step reads the buffer as it is)
    over the group the DDP reduce-scattered in, and the parameters are cut out at the buffer's
    param_index_map (which includes the optimizer's alignment padding)."""
    module = ddp.module
    trained = {k: p for k, p in module.named_parameters() if p.requires_grad}  # LoRA: the adapters only
    if not ddp.ddp_config.use_distributed_optimizer:
        return {k: p.main_grad.detach().clone() for k, p in trained.items()}
    group_of = {id(b): g for g in ddp.bucket_groups + ddp.expert_parallel_bucket_groups for b in g.buckets}
    reduced = {}
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        full = torch.empty_like(buffer.grad_data)
        for bucket in buffer.buckets:
            group = group_of[id(bucket)]
            size = group.intra_distributed_optimizer_instance_size
            rank = group.intra_distributed_optimizer_instance_rank
            # Megatron pads every bucket to a multiple of dp: equal shards, as it reduce-scattered them.
            shards = list(full[bucket.offset : bucket.offset + bucket.grad_data.numel()].chunk(size))
            n = shards[0].numel()
            dist.all_gather(
                shards,
                bucket.grad_data[rank * n : (rank + 1) * n].contiguous(),
                group=group.intra_distributed_optimizer_instance_group,
            )
        for p, (start, end, _) in buffer.param_index_map.items():
            reduced[p] = full[start:end].view(p.shape)
    return {k: reduced[p] for k, p in trained.items()}


def reduced_main_grads_by_param(ddp) -> dict:
    """{parameter: its DP-reduced gradient} of the trained parameters (LoRA: the adapters)."""
    params = dict(ddp.module.named_parameters())
    return {params[k]: g for k, g in _reduced_main_grads(ddp).items()}


def hf_grads(ddp, layout) -> dict:
    """Gradients after forward_backward (DP-reduced), under HF names, on every rank; correct with
    and without the distributed optimizer (see _reduced_main_grads)."""
    out = {}
    for unit, full in full_units(_reduced_main_grads(ddp), layout):
        out.update(unit_to_hf(unit, full, layout))
    return out


def save_hf_checkpoint(buckets, out_dir: str, source_hf_dir: str, is_main: bool, max_shard_bytes: int = 2 * 10**9):
    """An HF model directory of the policy's current weights: safetensors shards + index, the
    source model's config.json, tokenizer and chat template; loadable by transformers and vLLM as
    it is. buckets: policy.hf_weight_buckets() (collective: every rank iterates it, rank 0 writes).
    All or nothing: written beside out_dir and renamed into place (model/hf_io.staged_output_dir).
    A write that fails on rank 0 is raised only after every bucket was iterated: the buckets'
    gathers are collective, and the other ranks would wait in them for rank 0 until the timeout."""
    from megatron_dppo.model.hf_io import INDEX, copy_assets, staged_output_dir

    staging = staged_output_dir(out_dir) if is_main else contextlib.nullcontext()
    with staging as stage:
        shard, size, files, weight_map, total = {}, 0, [], {}, 0
        failed: list[OSError] = []

        def flush():
            nonlocal shard, size
            if shard and is_main and not failed:
                name = f"shard-{len(files):05d}.safetensors"
                tensors = {k: v.contiguous() for k, v in shard.items()}
                try:
                    save_file(tensors, os.path.join(stage, name), {"format": "pt"})
                except OSError as e:
                    failed.append(e)
                files.append((name, list(shard)))
            shard, size = {}, 0

        for bucket in buckets:
            for name, tensor in bucket:
                if is_main:
                    shard[name] = tensor.detach().cpu()
                    size += tensor.numel() * tensor.element_size()
                    total += tensor.numel() * tensor.element_size()
                if size >= max_shard_bytes:
                    flush()
        flush()
        if not is_main:
            return
        if failed:
            raise failed[0]
        for i, (name, names) in enumerate(files):  # HF's naming, now that the count is known
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            os.rename(os.path.join(stage, name), os.path.join(stage, final))
            weight_map.update({n: final for n in names})
        with open(os.path.join(stage, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        shutil.copyfile(os.path.join(source_hf_dir, "config.json"), os.path.join(stage, "config.json"))
        copy_assets(source_hf_dir, stage)
