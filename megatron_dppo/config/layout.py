"""The parallel layout against the model and the world size: what must divide what, one rule for
trainer, converters and `plan`. The model comes as its facts (model/arch.Arch: heads, layers,
widths, experts), from its config.json."""

from __future__ import annotations

import dataclasses

from megatron_dppo.config.schema import Config
from megatron_dppo.model.arch import Arch


def config_key(name: str, value) -> str:
    """How model_layout_problems names a parallel size by default: the config key and its value."""
    return f"parallel.{name}={value}"


def check_layout(cfg: Config, model: Arch, *, world_size: int, cuda: bool = True) -> None:
    """The parallel layout against the world and the model: ValueError naming every key to change.
    Shared by the trainer (world = torchrun's) and `megatron-dppo plan` (world = nodes x gpus_per_node);
    its model rules (model_layout_problems) by the conversion tools.
    cuda: NCCL's collectives (False: gloo's, on CPU).
    With parallel.rollout_ranks = R > 0 the Megatron layout covers the world's first world - R
    ranks and the vLLM engines its last R (rollout_tp divides R); 0: both cover the whole world."""
    par = cfg.parallel
    tp, rtp, rollout = par.tp, par.rollout_tp, par.rollout_ranks
    if rollout and not 0 < rollout < world_size:
        raise ValueError(
            f"invalid parallel layout: parallel.rollout_ranks={rollout} must leave training ranks: "
            f"at most the world size {world_size} - 1 (0 = colocated)"
        )
    train_world = world_size - rollout
    train_desc = (
        f"the training ranks {train_world} (world {world_size} - parallel.rollout_ranks={rollout})" if rollout else None
    )
    problems = model_layout_problems(
        model, tp=tp, pp=par.pp, ep=par.ep, etp=par.etp, world_size=train_world, cuda=cuda, world_desc=train_desc
    )
    num_heads, num_kv_heads = model.heads, model.kv_heads
    if par.gpus_per_node % tp:
        problems.append(
            f"parallel.tp={tp} must divide parallel.gpus_per_node={par.gpus_per_node}: a tensor-parallel "
            "group stays inside a node"
        )
    if model.experts and par.gpus_per_node % par.etp:
        problems.append(
            f"parallel.etp={par.etp} must divide parallel.gpus_per_node={par.gpus_per_node}: an "
            "expert-tensor-parallel group stays inside a node"
        )
    if model.experts and tp > 1 and not par.sequence_parallel:
        problems.append(
            f"parallel.tp={tp} with a mixture-of-experts model needs parallel.sequence_parallel=true "
            "(Megatron-Core's MoE layer refuses to train under TP without it)"
        )
    # vLLM shards query heads evenly, and KV heads evenly or replicated (tp a multiple of them).
    kv_ok = num_kv_heads % rtp == 0 if num_kv_heads >= rtp else rtp % num_kv_heads == 0
    engine_ranks = rollout or world_size  # the ranks the engines cover
    if rtp < 1 or engine_ranks % rtp or num_heads % rtp or not kv_ok:
        where = f"parallel.rollout_ranks={rollout}" if rollout else f"the world size {world_size}"
        problems.append(
            f"parallel.rollout_tp={rtp} must divide {where} and "
            f"num_attention_heads {num_heads}, and divide (or be a multiple of) "
            f"num_key_value_heads {num_kv_heads}"
        )
    if model.ffn % rtp:
        problems.append(f"parallel.rollout_tp={rtp} must divide intermediate_size {model.ffn}")
    if model.moe_ffn % rtp:  # vLLM splits each expert over its TP ranks
        problems.append(f"parallel.rollout_tp={rtp} must divide moe_intermediate_size {model.moe_ffn}")
    if par.gpus_per_node % rtp:
        problems.append(
            f"parallel.rollout_tp={rtp} must divide parallel.gpus_per_node={par.gpus_per_node}: one vLLM "
            "engine stays inside a node"
        )
    elif rollout and train_world % rtp:  # the engines start at rank world - R: keep each inside a node
        problems.append(
            f"parallel.rollout_tp={rtp} must divide the training ranks {train_world} (world {world_size} - "
            f"parallel.rollout_ranks={rollout}): the first rollout rank starts an engine, which stays inside a node"
        )
    if problems:
        raise ValueError("invalid parallel layout: " + "; ".join(problems))


def layout_choices(cfg: Config, arch: Arch) -> dict[str, list[int]]:
    """The values of parallel.tp, parallel.pp and parallel.rollout_tp (and parallel.ep for a
    mixture of experts) that check_layout accepts on this cluster (parallel.nodes x parallel.gpus_per_node)
    and model, each with the others at 1: what `megatron-dppo plan` offers in its refusals."""
    world = cfg.parallel.nodes * cfg.parallel.gpus_per_node
    knobs = ("tp", "pp", "rollout_tp") + (("ep",) if arch.experts else ())
    out = {}
    for knob in knobs:
        ok = []
        for value in range(1, world + 1):
            base = {"tp": 1, "pp": 1, "rollout_tp": 1, "ep": 1}
            par = dataclasses.replace(cfg.parallel, **{**base, knob: value})
            try:
                check_layout(dataclasses.replace(cfg, parallel=par), arch, world_size=world)
            except ValueError:
                continue
            ok.append(value)
        out[knob] = ok
    return out


def model_layout_problems(
    model: Arch,
    *,
    tp: int,
    pp: int,
    ep: int = 1,
    etp: int = 1,
    world_size: int,
    cuda: bool = True,
    show=config_key,
    world_desc: str | None = None,
) -> list[str]:
    """What Megatron-Core needs of a TP x PP (x EP x expert-TP) layout on this world and model, one
    problem per rule broken; show(name, value) names a size ("parallel.tp=3", or a tool's "--tp 3").

    Megatron-Core's initialize_model_parallel lays the expert groups (EP x expert-TP x expert-DP x
    PP) over the same world as the dense ones (TP x DP x PP), pipeline stages shared: ep x etp x pp
    must divide the world as tp x pp does; expert DP is what is left. Its alltoall token dispatcher
    all-gathers the tokens of an expert-TP group's ranks in each rank's own count (ranks of different
    data-parallel replicas hold different packs), which NCCL's all_gather does and gloo's refuses
    ("ProcessGroupGloo::allgather: invalid tensor size"): on CPU, etp is 1.
    world_desc: how the messages name world_size (default "the world size N")."""
    num_heads, num_kv_heads, num_layers, num_experts = model.heads, model.kv_heads, model.layers, model.experts
    problems, world = [], world_desc or f"the world size {world_size}"
    if min(tp, pp, ep, etp) < 1:
        return [f"{show('tp', tp)}, {show('pp', pp)}, {show('ep', ep)} and {show('etp', etp)} must be >= 1"]
    if world_size % (tp * pp):
        problems.append(f"{show('tp', tp)} x {show('pp', pp)} must divide {world}")
    if num_heads % tp or num_kv_heads % tp:
        problems.append(
            f"{show('tp', tp)} must divide num_attention_heads {num_heads} and num_key_value_heads {num_kv_heads}"
        )
    if model.ffn % tp:
        problems.append(f"{show('tp', tp)} must divide intermediate_size {model.ffn}")
    if num_layers % pp:
        problems.append(f"{show('pp', pp)} must divide num_hidden_layers {num_layers}")
    if (ep > 1 or etp > 1) and not num_experts:
        sizes = " and ".join(show(k, v) for k, v in (("ep", ep), ("etp", etp)) if v > 1)
        problems.append(
            f"{sizes} need{'s' if ' and ' not in sizes else ''} a mixture-of-experts model (this one is dense)"
        )
        return problems
    if not num_experts:
        return problems
    if world_size % (ep * etp * pp):
        problems.append(f"{show('ep', ep)} x {show('etp', etp)} x {show('pp', pp)} must divide {world}")
    if num_experts % ep:
        problems.append(f"{show('ep', ep)} must divide num_experts {num_experts}")
    if model.moe_ffn % etp:
        problems.append(f"{show('etp', etp)} must divide moe_intermediate_size {model.moe_ffn}")
    if etp > 1 and not cuda:
        problems.append(
            f"{show('etp', etp)} cannot run on CPU: Megatron-Core's token dispatcher all-gathers the "
            "expert-TP group's tokens in each rank's own count, which gloo's all_gather refuses (split "
            "the experts with parallel.ep instead, and keep parallel.etp=1)"
        )
    return problems
