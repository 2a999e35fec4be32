"""`megatron-dppo plan --smallest`: the fewest GPUs a run fits on, and the layout that does it.

Worlds are tried in increasing size: 1, 2, 4, ... GPUs on one node (fewer than
parallel.gpus_per_node), then 1, 2, 4, ... whole nodes, up to --max-gpus. On each, every layout
the trainer accepts (config.check_layout, through memory_plan) over parallel.tp (1-8), pp (1-16),
ep (a mixture of experts: 1 to num_experts), recompute and rollout_tp (1-8) is planned, with
sequence parallel on where tp > 1 and the distributed optimizer on; everything else (the
micro-batch, vLLM's share, model.lora, ...) is the config's. The first world with a layout that
fits is the answer, and of its layouts the one with the least recomputation, then the fewest
model-parallel ranks (tp x pp, then pp, then ep), then the smallest rollout_tp, then the lowest
peak. A (tp, pp, ep) whose lightest variant (recompute full, the largest rollout_tp) does not fit
is skipped whole: recomputing more and a wider vLLM engine only lower the peak.
"""

from __future__ import annotations

import dataclasses

from megatron_dppo.jobs.plan import _model_arch, _peak, memory_plan

RECOMPUTE = ("none", "selective", "full")  # most memory (and least compute) first
TP, PP, ROLLOUT_TP = (1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8)
EP = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def worlds(gpus_per_node: int, max_gpus: int) -> list[tuple[int, int]]:
    """(nodes, GPUs per node) in increasing size: part of one node, then whole nodes."""
    out, g = [], 1
    while g < gpus_per_node and g <= max_gpus:
        out.append((1, g))
        g *= 2
    nodes = 1
    while nodes * gpus_per_node <= max_gpus:
        out.append((nodes, gpus_per_node))
        nodes *= 2
    return out


def overrides(layout: dict) -> str:
    """A layout as the parallel.* overrides that reproduce it on the command line."""
    return " ".join(f"parallel.{k}={str(v).lower()}" for k, v in layout.items())


def _plan(cfg, layout: dict, model: tuple):
    """memory_plan of cfg with these parallel.* values, None when the trainer refuses the layout.
    (dataclasses.replace, not the override parser: the search plans thousands of layouts.)"""
    try:
        return memory_plan(
            dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **layout)), fixes=False, model=model
        )
    except ValueError:
        return None


def _fits_at(cfg, model: tuple, layout: dict) -> list[tuple]:
    """(preference key, layout, plan) of each recompute level's narrowest fitting rollout_tp for
    this world, tp, pp and ep; [] at once when the lightest variant does not fit or is refused."""
    lightest = next(
        (p for r in reversed(ROLLOUT_TP) if (p := _plan(cfg, {**layout, "recompute": "full", "rollout_tp": r}, model))),
        None,
    )
    if lightest is None or not lightest["fits"]:
        return []
    out = []
    for level, recompute in enumerate(RECOMPUTE):
        for rtp in ROLLOUT_TP:
            full = {**layout, "recompute": recompute, "rollout_tp": rtp}
            p = _plan(cfg, full, model)
            if p and p["fits"]:
                tp, pp, ep = layout["tp"], layout["pp"], layout["ep"]
                out.append(((level, tp * pp, pp, ep, rtp, _peak(p)), full, p))
                break  # a wider engine at the same recompute is never preferred
    return out


def _layouts(world: dict, experts: int, sequence_parallel: bool = True):
    """Every (tp, pp, ep) to try on a world: sequence parallel where tp > 1 (unless not
    `sequence_parallel`: LoRA's adapters need each linear's whole input), the distributed optimizer on."""
    gpus = world["nodes"] * world["gpus_per_node"]
    for tp in TP:
        for pp in PP:
            for ep in [e for e in EP if e <= min(experts, gpus)] if experts else [1]:
                yield {
                    **world,
                    "tp": tp,
                    "pp": pp,
                    "ep": ep,
                    "etp": 1,
                    "sequence_parallel": sequence_parallel and tp > 1,
                    "distributed_optimizer": True,
                }


def smallest_layout(cfg, max_gpus: int = 1024) -> dict | None:
    """{'gpus', 'overrides', 'plan', 'tried'} of the fewest GPUs this run fits on (module
    docstring), None when nothing up to max_gpus fits. ValueError for a config the search
    cannot vary (dedicated rollout ranks)."""
    par = cfg.parallel
    if par.rollout_ranks:
        raise ValueError(
            f"--smallest: searches colocated layouts; parallel.rollout_ranks={par.rollout_ranks} must be 0"
        )
    model = _model_arch(cfg.model.hf_dir)
    tried = []
    for nodes, per_node in worlds(par.gpus_per_node, max_gpus):
        tried.append(nodes * per_node)
        world = {"nodes": nodes, "gpus_per_node": per_node}
        fits = [
            f
            for layout in _layouts(world, model[0].experts, not cfg.model.lora.rank)
            for f in _fits_at(cfg, model, layout)
        ]
        if fits:
            _, layout, plan = min(fits, key=lambda f: f[0])
            return {"gpus": nodes * per_node, "overrides": overrides(layout), "plan": plan, "tried": tried}
    return None


def format_smallest(found: dict | None, max_gpus: int) -> str:
    if found is None:
        return f"smallest layout: none fits on up to {max_gpus} GPUs (--max-gpus)"
    lay = found["plan"]["layout"]
    return (
        f"smallest layout that fits: {found['gpus']} GPUs ({lay['nodes']} x {lay['gpus_per_node']}), "
        f"peak {_peak(found['plan']) / (1 << 30):.1f} GiB; tried {found['tried']} GPUs; as overrides: "
        f"{found['overrides']}"
    )
