"""LoRA adapters on Megatron-Core's tensor-parallel linears (model.lora).

Written here because nothing maintained does it on this stack: Megatron-Core 0.16-0.19 has no LoRA
layer, and megatron-bridge's PEFT builds on Transformer Engine's linears, which do not run on the
CPU. The adapters are PEFT's, one pair per Hugging Face module, so that a PEFT adapter directory
maps onto them one to one and vLLM serves them unchanged:

    y = W x + (alpha / r) * B (A dropout(x)),   A: [r, in], B: [out, r], B = 0 at the start

A Megatron linear that fuses several HF modules carries one pair per module and lays their outputs
out as the fused weight does (linear_qkv: q, k, v interleaved per query group; linear_fc1: [gate;
up] on every TP rank). Under tensor parallelism each pair is split the way its linear is:

    column-parallel (qkv, fc1): A replicated, B split on its rows. h = A x is the same on every TP
        rank, and its gradient is summed over TP (copy_to_tensor_model_parallel_region) because
        each rank's B sees only its rows.
    row-parallel (proj, fc2): A split on its columns, B replicated. The partial h_t = A_t x_t are
        summed over TP (reduce_from_tensor_model_parallel_region) before B.

So every TP/PP layout computes the same function and the same gradients (tests/dist: against PEFT
on one process). The base weights are frozen (requires_grad False): Megatron's DDP makes no gradient
buffer for them and its optimizer (distributed or not) holds only the adapters.

The adapters hang off the GPTModel as one child, `lora_adapters`, keyed by their global HF names
(any PP stage, any EP rank), and reach the linears through forward hooks, so the base linears'
names, checkpoints keys and weight export are untouched. Their own sharded_state_dict gives the
checkpoint global shapes with TP offsets. `disabled()` turns them off: the base model, which is the
KL reference (no second copy of the weights).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

from megatron_dppo.model.peft_dir import ROLE_MODULES

# ROLE_MODULES: Megatron's linears by role -> the HF modules each one fuses, in the fused weight's order
ROLE_LINEAR = {"qkv": "linear_qkv", "proj": "linear_proj", "fc1": "linear_fc1", "fc2": "linear_fc2"}
COLUMN_ROLES = ("qkv", "fc1")
CHILD = "lora_adapters"  # the GPTModel's child holding every adapter


def is_adapter(name: str) -> bool:
    """A model's parameter or state-dict name that is an adapter's (under the `lora_adapters` child)."""
    return name.startswith(CHILD + ".")


def base_parameters(module: torch.nn.Module) -> dict:
    """{local megatron name: parameter} of the model itself, without its adapters (which have no
    HF base name: LoraAdapters exports them)."""
    return {k: p for k, p in module.named_parameters() if not is_adapter(k)}


@dataclass(frozen=True)
class LoraSettings:
    """model.lora as the model applies it."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = tuple(ROLE_MODULES)
    experts: bool = False
    seed: int = 0  # A's initialisation (B starts at 0): the same on every layout

    @classmethod
    def from_config(cls, lora, seed: int = 0) -> LoraSettings | None:
        """None when model.lora.rank is 0 (full fine-tuning)."""
        if not lora.rank:
            return None
        return cls(lora.rank, float(lora.alpha), float(lora.dropout), tuple(lora.targets), bool(lora.experts), seed)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _initial_a(name: str, rank: int, fan_in: int, seed: int) -> torch.Tensor:
    """A's full [rank, fan_in] start, as PEFT draws it (kaiming_uniform with a=sqrt(5): U(+-1/sqrt(fan_in))),
    from a generator of its own name, so it depends on neither the layout nor the build order."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(fan_in)
    return torch.rand(rank, fan_in, generator=gen, dtype=torch.float32) * (2 * bound) - bound


class LinearAdapters(torch.nn.Module):
    """The adapters of one Megatron linear: a (lora_A, lora_B) per HF module it fuses."""

    def __init__(self, role: str, hf_prefix: str, linear, settings: LoraSettings, sizes: list[int], groups: int, group):
        """sizes: each HF module's rows of this rank's fused output (qkv: q, k, v; fc1: gate, up);
        groups: this rank's query groups (qkv's interleave); group: the linear's TP group."""
        super().__init__()
        self.role, self.column = role, role in COLUMN_ROLES
        self.names = [f"{hf_prefix}.{m}" for m in ROLE_MODULES[role]]  # e.g. model.layers.3.self_attn.q_proj
        self.scale, self.groups, self.group = settings.scale, groups, group
        self.tp_size, self.tp_rank = group.size(), group.rank()
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout else torch.nn.Identity()
        weight = linear.weight
        out_local, in_local = weight.shape
        assert sum(sizes) == out_local, (hf_prefix, role, sizes, out_local)
        full_in = in_local if self.column else in_local * self.tp_size
        self.pairs = torch.nn.ModuleList()
        for name, out in zip(self.names, sizes):
            pair = torch.nn.Module()
            a = _initial_a(name, settings.rank, full_in, settings.seed)
            if not self.column:
                a = a.chunk(self.tp_size, dim=1)[self.tp_rank]
            pair.lora_A = torch.nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
            pair.lora_B = torch.nn.Parameter(torch.zeros(out, settings.rank, device=weight.device, dtype=weight.dtype))
            split = pair.lora_B if self.column else pair.lora_A
            set_tensor_model_parallel_attributes(split, True, 0 if self.column else 1, 1)
            for p in (pair.lora_A, pair.lora_B):  # experts: reduced over the expert-data-parallel group
                p.allreduce = getattr(weight, "allreduce", True)
            self.pairs.append(pair)

    def _fuse(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """The pairs' outputs laid out as the fused linear's output is."""
        if self.role == "qkv":
            g = self.groups
            parts = [o.reshape(*o.shape[:-1], g, o.shape[-1] // g) for o in outs]
            fused = torch.cat(parts, dim=-1)
            return fused.reshape(*fused.shape[:-2], -1)
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dropout(x)
        if self.column:
            outs = []
            for pair in self.pairs:
                h = copy_to_tensor_model_parallel_region(F.linear(x, pair.lora_A), group=self.group)
                outs.append(F.linear(h, pair.lora_B))
            return self._fuse(outs) * self.scale
        (pair,) = self.pairs
        h = reduce_from_tensor_model_parallel_region(F.linear(x, pair.lora_A), group=self.group)
        return F.linear(h, pair.lora_B) * self.scale

    # ---- checkpoint and export: global tensors under HF names ------------------------------------
    def factors(self):
        """(pair index, HF module name, "lora_A" | "lora_B", this rank's parameter, its TP-split
        dimension or None where it is replicated) of every factor: A and B of each pair."""
        a_dim, b_dim = (None, 0) if self.column else (1, None)
        for j, (name, pair) in enumerate(zip(self.names, self.pairs)):
            yield j, name, "lora_A", pair.lora_A, a_dim
            yield j, name, "lora_B", pair.lora_B, b_dim


class LoraAdapters(torch.nn.Module):
    """Every adapter of this rank's model stage, keyed by HF module name (global layer and expert)."""

    def __init__(self, settings: LoraSettings):
        super().__init__()
        self.settings = settings
        self.linears = torch.nn.ModuleDict()
        self.enabled = True
        self._expert_keys: set[str] = set()

    def add(self, key: str, adapters: LinearAdapters, expert: bool) -> None:
        self.linears[key] = adapters
        if expert:
            self._expert_keys.add(key)

    @contextlib.contextmanager
    def disabled(self):
        """The base model: the adapters add nothing (the KL reference's forward)."""
        self.enabled, before = False, self.enabled
        try:
            yield
        finally:
            self.enabled = before

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """{state-dict name: ShardedTensor}, each saved under its global HF name,
        {prefix}model.layers.L.self_attn.q_proj.lora_A, with TP offsets (experts: over the
        expert-TP and expert-DP groups), so a checkpoint loads at any TP/PP."""
        out = {}
        for key, lin in self.linears.items():
            kw = {}
            if key in self._expert_keys:
                kw = dict(
                    tp_group=parallel_state.get_expert_tensor_parallel_group(),
                    dp_cp_group=parallel_state.get_expert_data_parallel_group(),
                )
            for j, name, suffix, tensor, split in lin.factors():
                local, saved = f"{prefix}linears.{key}.pairs.{j}.{suffix}", f"{prefix}{name}.{suffix}"
                if split is None:
                    out[local] = make_sharded_tensor_for_checkpoint(tensor, saved, **kw)
                else:
                    out[local] = make_tp_sharded_tensor_for_checkpoint(tensor, saved, tp_axis=split, **kw)
        return out

    def hf_tensors(self, values: dict | None = None) -> dict[str, torch.Tensor]:
        """This stage's adapters merged over TP (expert-TP), under HF names
        (model.layers.L.self_attn.q_proj.lora_A.weight, ...), on the CPU. values: {parameter:
        tensor} to export instead of the parameters themselves (their gradients)."""
        out = {}
        for lin in self.linears.values():
            for _, name, suffix, param, dim in lin.factors():
                t = (param if values is None else values[param]).detach()
                if dim is not None and lin.tp_size > 1:
                    shards = [torch.empty_like(t) for _ in range(lin.tp_size)]
                    dist.all_gather(shards, t.contiguous(), group=lin.group)
                    t = torch.cat(shards, dim=dim)
                out[f"{name}.{suffix}.weight"] = t.cpu().clone()
        return out

    @torch.no_grad()
    def load_hf_tensors(self, full: dict[str, torch.Tensor], where: str = "the adapters") -> None:
        """Copy whole HF-named adapters (hf_tensors' names; a PEFT directory's without its
        base_model.model. prefix) into this rank's slices. Every adapter of this stage must be there."""
        for lin in self.linears.values():
            for _, name, suffix, param, dim in lin.factors():
                key = f"{name}.{suffix}.weight"
                if key not in full:
                    raise ValueError(f"{where} have no {key} (model.lora.targets={list(self.settings.targets)})")
                t = full[key]
                if dim is not None and lin.tp_size > 1:
                    t = t.chunk(lin.tp_size, dim=dim)[lin.tp_rank]
                if tuple(t.shape) != tuple(param.shape):
                    raise ValueError(
                        f"{where}: {key} has shape {tuple(full[key].shape)}, this model's adapter "
                        f"(model.lora.rank={self.settings.rank}) needs {tuple(param.shape)} on this rank"
                    )
                param.copy_(t)


def gather_over_stages(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every PP stage's (and EP rank's) adapters on every rank: they are small (r x (in + out) per
    module), so objects over the PP and EP groups do, where the full weights stream by unit."""
    out = dict(local)
    for group in (parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_expert_model_parallel_group()):
        if group is not None and dist.get_world_size(group) > 1:
            parts = [None] * dist.get_world_size(group)
            dist.all_gather_object(parts, out, group=group)
            out = {k: v for part in parts for k, v in part.items()}
    return dict(sorted(out.items()))


def _hook(container: LoraAdapters, adapters: LinearAdapters):
    def add_adapters(module, args, kwargs, output):
        if not container.enabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + adapters(x).to(out.dtype), bias

    return add_adapters


def _check_linear(linear, where: str) -> None:
    if not isinstance(linear, (ColumnParallelLinear, RowParallelLinear)):
        raise ValueError(
            f"model.lora: {where} is a {type(linear).__name__}, not Megatron-Core's ColumnParallelLinear or "
            "RowParallelLinear: the adapters are written for the local layer spec (model.attention=local); "
            "Transformer Engine's linears fuse the input norm into linear_qkv/linear_fc1"
        )


def _expert_linears(mlp):
    """(global expert index, expert MLP) of an MoE layer's local experts (SequentialMLP only)."""
    experts = getattr(mlp, "experts", None)
    local = getattr(experts, "local_experts", None)
    if local is None:
        raise ValueError(
            f"model.lora.experts=true: this MoE layer's experts are a {type(experts).__name__}, whose weights are "
            "grouped tensors, not per-expert linears; the adapters need the local spec's SequentialMLP"
        )
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    first = ep_rank * len(local)
    return [(first + i, expert) for i, expert in enumerate(local)]


def add_adapters(model, settings: LoraSettings) -> LoraAdapters:
    """Freeze `model` (a GPTModel stage) and hang adapters on the targeted linears of its layers.
    Call before DDP wraps it (DDP makes gradient buffers for what requires grad when it is built)."""
    for p in model.parameters():
        p.requires_grad_(False)
    container = LoraAdapters(settings)
    cfg = model.config
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = tp_group.size()
    heads_per_group = cfg.num_attention_heads // cfg.num_query_groups
    groups_local = cfg.num_query_groups // tp
    q_rows, kv_rows = groups_local * heads_per_group * cfg.kv_channels, groups_local * cfg.kv_channels

    def attach(role: str, linear, hf_prefix: str, key: str, group, expert: bool) -> None:
        _check_linear(linear, f"{hf_prefix} ({ROLE_LINEAR[role]})")
        rows = linear.weight.shape[0]
        sizes = {"qkv": [q_rows, kv_rows, kv_rows], "fc1": [rows // 2, rows // 2]}.get(role, [rows])
        adapters = LinearAdapters(role, hf_prefix, linear, settings, sizes, groups_local, group)
        container.add(key, adapters, expert)
        linear.register_forward_hook(_hook(container, adapters), with_kwargs=True)

    for layer in model.decoder.layers:
        i = layer.layer_number - 1  # global (PP: this stage's first layer is not 0)
        attention = layer.self_attention
        for role in ("qkv", "proj"):
            if role in settings.targets:
                attach(
                    role,
                    getattr(attention, ROLE_LINEAR[role]),
                    f"model.layers.{i}.self_attn",
                    f"L{i}_{role}",
                    tp_group,
                    False,
                )
        mlp_roles = [r for r in ("fc1", "fc2") if r in settings.targets]
        if hasattr(layer.mlp, "router"):  # an MoE layer: per-expert adapters, or none
            if settings.experts:
                etp_group = parallel_state.get_expert_tensor_parallel_group()
                for e, expert in _expert_linears(layer.mlp):
                    for role in mlp_roles:
                        linear = getattr(expert, ROLE_LINEAR[role])
                        attach(role, linear, f"model.layers.{i}.mlp.experts.{e}", f"L{i}_E{e}_{role}", etp_group, True)
            continue
        for role in mlp_roles:
            attach(
                role, getattr(layer.mlp, ROLE_LINEAR[role]), f"model.layers.{i}.mlp", f"L{i}_{role}", tp_group, False
            )
    model.add_module(CHILD, container)
    return container


def adapters_of(model) -> LoraAdapters | None:
    """The model's LoraAdapters (through a DDP wrapper too), or None."""
    module = getattr(model, "module", model)
    return getattr(module, CHILD, None)
