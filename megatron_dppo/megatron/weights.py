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
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from megatron_dppo.convert import qwen3 as mapping
from megatron_dppo.megatron.hf_load import expert_rank_layout, rank_layout
from megatron_dppo.megatron.model import current_device


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


def _is_expert(name: str) -> bool:
    return mapping.expert_index(name) is not None


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
    return -1 if unit == "embedding" else (10**9 if unit == "head" else unit)


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
        own = {k for k in module.state_dict() if not k.endswith("_extra_state")}
        missing, unexpected = own - local.keys(), local.keys() - own
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
            )
        with torch.no_grad():
            params = dict(module.named_parameters())
            for name, tensor in local.items():
                params[name].copy_(tensor)


def non_finite(module: torch.nn.Module, layout, grads: bool = False) -> list[str]:
    """Global megatron names of this rank's parameters (or, with grads, their main_grad) holding
    a NaN or an infinity (an expert by its global number)."""
    ranks = _Ranks.current()
    out = []
    for name, p in module.named_parameters():
        t = getattr(p, "main_grad", None) if grads else p
        if t is not None and not bool(torch.isfinite(t).all()):
            out.append(ranks.global_name(name, layout))
    return out


def copy_parameters(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """dst := src, shard by shard (both built with the same TP/PP layout: no communication)."""
    a, b = dict(src.named_parameters()), dict(dst.named_parameters())
    if a.keys() != b.keys():
        raise ValueError(f"the two models differ in their parameters: {sorted(a.keys() ^ b.keys())[:5]}")
    with torch.no_grad():
        for name, p in b.items():
            p.copy_(a[name])


def _produced(local: str, t: torch.Tensor, ranks: _Ranks, layout) -> list:
    """(global name, full shape, dtype) of what this rank's stage makes of one local tensor: one
    entry, or for an expert one per EP rank (every EP rank holds the same local names)."""
    if not _is_expert(local):
        return [(ranks.global_name(local, layout), _merged_shape(local, t.shape, ranks.tp_size), t.dtype)]
    shape = _merged_shape(local, t.shape, ranks.etp_size)
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


def _merge_split(name: str, t: torch.Tensor, size: int, group) -> torch.Tensor:
    """The full tensor from its `size` slices over `group` (TP, or expert-TP for an expert)."""
    if size == 1 or mapping.tp_split_kind(name) == "replicated":
        return t
    shards = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(shards, t.contiguous(), group=group)
    return mapping.tp_merge(name, shards)


def _stage_unit(names: list, tensors: dict, ranks: _Ranks, layout) -> dict:
    """{global name: full tensor} of one unit of this rank's stage: dense tensors merged over TP,
    experts merged over expert-TP (never over TP) and all-gathered over EP (rank r's local
    expert e is global expert r E/ep + e). Collective over the TP, expert-TP and EP groups, whose
    ranks all hold the same local names: they iterate them in the same (sorted) order."""
    ps = parallel_state
    out = {}
    for local in sorted(names):
        t = tensors[local]
        if not _is_expert(local):
            out[ranks.global_name(local, layout)] = _merge_split(
                local, t, ranks.tp_size, ps.get_tensor_model_parallel_group()
            )
            continue
        t = _merge_split(local, t, ranks.etp_size, ps.get_expert_tensor_parallel_group()).contiguous()
        parts = [t]
        if ranks.ep_size > 1:
            parts = [torch.empty_like(t) for _ in range(ranks.ep_size)]
            dist.all_gather(parts, t, group=ps.get_expert_model_parallel_group())
        for r, part in enumerate(parts):
            out[ranks.global_name(local, layout, ep_rank=r)] = part
    return out


def full_units(tensors: dict, layout):
    """Local megatron-named tensors -> full tensors (TP- and expert-TP-merged, every EP rank's
    experts) of every PP stage, on every rank, one unit at a time. Yields (unit, {global megatron
    name: full tensor}). Collective over the world."""
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
    for unit in sorted(units, key=_unit_order):
        own = _stage_unit(mine.get(unit, []), tensors, ranks, layout)
        out = {}
        for k in sorted(units[unit]):
            stage, src, shape, dtype = meta[k]
            buf = (
                own[k].contiguous()
                if stage == ranks.pp_rank
                else torch.empty(shape, dtype=dtype, device=current_device())
            )
            if ranks.pp_size > 1:
                dist.broadcast(buf, src=src, group=pp_group)
            out[k] = buf
        yield unit, out


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
    """The module's current weights under HF names, in buckets of about bucket_bytes, on every
    rank. A generator: the weight sync streams a large model instead of gathering it whole."""
    local = {k: v.detach() for k, v in module.named_parameters()}
    bucket, size = [], 0
    for unit, full in full_units(local, layout):
        for name, t in unit_to_hf(unit, full, layout).items():
            bucket.append((name, t))
            size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
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
    if not ddp.ddp_config.use_distributed_optimizer:
        return {k: p.main_grad.detach().clone() for k, p in module.named_parameters()}
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
    return {k: reduced[p] for k, p in module.named_parameters()}


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
    All or nothing: written beside out_dir and renamed into place (convert/hf_io.staged_output_dir)."""
    from megatron_dppo.convert.hf_io import INDEX, copy_assets, staged_output_dir

    staging = staged_output_dir(out_dir) if is_main else contextlib.nullcontext()
    with staging as stage:
        shard, size, files, weight_map, total = {}, 0, [], {}, 0

        def flush():
            nonlocal shard, size
            if shard and is_main:
                name = f"shard-{len(files):05d}.safetensors"
                save_file({k: v.contiguous() for k, v in shard.items()}, os.path.join(stage, name), {"format": "pt"})
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
        for i, (name, names) in enumerate(files):  # HF's naming, now that the count is known
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            os.rename(os.path.join(stage, name), os.path.join(stage, final))
            weight_map.update({n: final for n in names})
        with open(os.path.join(stage, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        shutil.copyfile(os.path.join(source_hf_dir, "config.json"), os.path.join(stage, "config.json"))
        copy_assets(source_hf_dir, stage)
