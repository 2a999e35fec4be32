"""Worker: a Qwen3 MoE's DPPO gradient and its router terms against a plain-PyTorch reference.

    python moe_grad_check.py [--recompute R]                     # EP=1, one process
    torchrun --nproc_per_node 2 moe_grad_check.py --ep 2          # EP=2, dense DP=2 (the world)
    torchrun --nproc_per_node 2 moe_grad_check.py --ep 1          # DP=2, experts replicated (expert DP=2)
    torchrun --nproc_per_node 2 moe_grad_check.py --pp 2          # PP=2 (layers 0-1 | 2-3)
    torchrun --nproc_per_node 2 moe_grad_check.py --etp 2         # expert-TP 2: the weights' round trip only

Every rank builds the same problem as grad_check.py on the tiny random MoE (tests/tiny_models.py:
8 experts, top-2, layer 1 dense) and, with the distributed optimizer off and on, and 1 or several
micro-batches per rank:
0. the HF weights loaded into this rank's shard and exported back (policy.hf_state_dict) are
   bitwise the HF weights;
1. router terms off: policy.hf_grads() (DP-reduced over dense DP, experts over expert DP, the
   experts gathered over EP, under HF names) equals transformers' gradient of the DPPO loss; and
   it is bitwise the gradient of the dense-model code path (no padding mask, no router hooks);
2. algorithm.moe_aux_loss_coeff and moe_z_loss_coeff on: the gradient equals transformers'
   gradient of the DPPO loss + the two terms computed independently from transformers' router
   logits (router_stats.py's formulas: per micro-batch Switch loss weighted by its tokens over the
   update's tokens; z-loss a token mean over the update, padding excluded), and the reported
   moe_aux_loss / moe_z_loss / moe_load_imbalance equal the reference's values.
Also: the z-loss does not depend on the micro-batching, the load-balancing loss does (a pack of
other tokens is another Switch batch). Rank 0 prints MOE GRAD CHECK PASSED.
"""

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from grad_check import MAX_NEW, B, G, make_problem, my_microbatches, reference_grads  # noqa: E402
from tiny_models import hf_checkpoint_tensors, tiny_qwen3_moe_model  # noqa: E402

from megatron_dppo.algorithms import losses  # noqa: E402
from megatron_dppo.algorithms.packing import balance_packs, pack  # noqa: E402
from megatron_dppo.config import AlgorithmConfig, OptimConfig  # noqa: E402
from megatron_dppo.megatron import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402

AUX, Z = 1e-3, 1e-4  # Qwen3-MoE's router_aux_loss_coef; the z-loss at a tenth of it
TOL = 1e-5


def router_terms(model, samples, capacity, dp_size, aux_coeff, z_coeff):
    """The update's two router terms on transformers' router logits (differentiable) and each
    MoE layer's expert load, for the micro-batches my_microbatches builds on all dp_size ranks
    (balance_packs splits packs until every rank has as many)."""
    logits = {}
    gates = [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
    hooks = [g.register_forward_hook(lambda m, a, out, i=i: logits[i].append(out[0])) for i, g in gates]
    per_seq = []
    for s in samples:
        for i, _ in gates:
            logits[i] = []
        model(torch.as_tensor(s.tokens)[None])
        per_seq.append({i: logits[i][0] for i, _ in gates})
    for h in hooks:
        h.remove()
    E, k = model.config.num_experts, model.config.num_experts_per_tok
    total = sum(len(s.tokens) for s in samples)
    aux = z = torch.zeros((), dtype=torch.float64)
    load = {i: torch.zeros(E, dtype=torch.float64) for i, _ in gates}
    lengths = [len(s.tokens) for s in samples]
    for p in (p for rank in balance_packs(pack(lengths, capacity, window=4), lengths, dp_size) for p in rank):
        for i, _ in gates:
            zl = torch.cat([per_seq[j][i] for j in p]).float()
            probs = torch.softmax(zl, -1)
            routed = torch.zeros_like(probs).scatter(1, probs.topk(k, -1).indices, 1.0)
            t = zl.shape[0]
            switch = E / (k * t * t) * (probs.sum(0) * routed.sum(0)).sum()
            aux = aux + aux_coeff * (t / total) * switch.double()
            z = z + z_coeff * torch.logsumexp(zl, -1).pow(2).sum().double() / total
            load[i] += routed.sum(0).double()
    imbalance = sum(float(c.max() / c.mean()) for c in load.values()) / len(load)
    return aux, z, imbalance


def reference(model, samples, loss_cfg, denom, capacity, dp_size, aux_coeff=0.0, z_coeff=0.0):
    """(DPPO loss, router terms, load imbalance, gradients under HF checkpoint names)."""
    loss, _ = reference_grads(model, samples, loss_cfg, denom)  # leaves the policy loss's gradient
    aux, z, imbalance = router_terms(model, samples, capacity, dp_size, aux_coeff, z_coeff)
    if aux_coeff or z_coeff:
        (aux + z).backward()  # adds to the policy loss's gradient
    return loss, float(aux), float(z), imbalance, hf_checkpoint_tensors(model, grads=True)


def rel_err(got: dict, ref: dict) -> float:
    assert got.keys() == ref.keys(), sorted(got.keys() ^ ref.keys())[:6]
    num = sum(float((got[n] - ref[n]).double().pow(2).sum()) for n in ref)
    return math.sqrt(num / sum(float(ref[n].double().pow(2).sum()) for n in ref))


def close(a: float, b: float, rel: float = TOL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def build_policies(cfg, weights, loss_cfg, args, dist_opt) -> dict:
    """{(aux, z) coefficients: policy} with the HF weights loaded; checks their round trip."""
    policies = {
        coeffs: MegatronPolicy(
            cfg,
            OptimConfig(lr=1e-3),
            AlgorithmConfig(**{**vars(loss_cfg), "moe_aux_loss_coeff": coeffs[0], "moe_z_loss_coeff": coeffs[1]}),
            recompute=args.recompute,
            distributed_optimizer=dist_opt,
        )
        for coeffs in ((0.0, 0.0), (AUX, Z))
    }
    for p in policies.values():
        p.load_hf_state_dict(weights)
        # dense and expert weights apart at every EP (checkpoints resume across EP sizes)
        assert len(p.optimizer.chained_optimizers) == 2 and p.model.expert_parallel_buffers
        # loaded into this rank's shard and exported (merged over expert-TP, gathered over EP): bitwise
        exported = p.hf_state_dict()
        assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)
    return policies


def check_case(policies, model, problem, capacity, dp_rank, dp_size) -> tuple[dict, str]:
    """Checks 1 and 2 of the module docstring for one micro-batching; (metrics with the terms on,
    a line saying what was measured)."""
    samples, loss_cfg, denom = problem
    mbs = my_microbatches(samples, capacity, dp_rank, dp_size)
    ref_loss, _, _, ref_imb, ref = reference(model, samples, loss_cfg, denom, capacity, dp_size)
    off = policies[(0.0, 0.0)]
    m0 = off.forward_backward(mbs, denom)
    g0 = off.hf_grads()
    err0 = rel_err(g0, ref)
    assert err0 < TOL and abs(m0["loss"] - ref_loss) <= TOL * max(1.0, abs(ref_loss)), (err0, m0, ref_loss)
    assert m0["moe_aux_loss"] == 0.0 and m0["moe_z_loss"] == 0.0, m0
    assert close(m0["moe_load_imbalance"], ref_imb), (m0["moe_load_imbalance"], ref_imb)
    # The dense code path (router_stats None: no padding mask, no hooks) gives the same bits.
    stats, off.router_stats = off.router_stats, None
    off.forward_backward(mbs, denom)
    plain = off.hf_grads()
    off.router_stats = stats
    assert all(torch.equal(plain[n], g0[n]) for n in g0), "router terms off changed the policy gradient"

    _, ref_aux, ref_z, _, ref_on = reference(model, samples, loss_cfg, denom, capacity, dp_size, AUX, Z)
    m1 = policies[(AUX, Z)].forward_backward(mbs, denom)
    err1 = rel_err(policies[(AUX, Z)].hf_grads(), ref_on)
    moved = rel_err(g0, ref_on)  # how far the terms move the gradient: the check can fail
    assert err1 < TOL < moved, (capacity, err1, moved)
    assert close(m1["moe_aux_loss"], ref_aux) and close(m1["moe_z_loss"], ref_z), (m1, ref_aux, ref_z)
    assert close(m1["loss"], m0["loss"]), "the reported policy loss must not include the router terms"
    line = (
        f"micro-batches/rank={len(mbs)}: off rel.grad.err={err0:.2e}, on rel.grad.err={err1:.2e} "
        f"(terms move it {moved:.2e}); aux={m1['moe_aux_loss']:.6e} (ref {ref_aux:.6e}) "
        f"z={m1['moe_z_loss']:.6e} (ref {ref_z:.6e}) imbalance={m0['moe_load_imbalance']:.4f}"
    )
    return m1, line


def check_non_finite_names(policy, ps, args) -> None:
    """A non-finite expert weight is named by its global layer and expert numbers: EP rank r's
    local expert 1 is expert r * 8 / ep + 1; a stage's local layer L is layer L + stage * 4 / pp."""
    params = dict(policy.model.module.named_parameters())
    name = next(n for n in params if n.endswith("local_experts.1.linear_fc2.weight"))
    with torch.no_grad():
        params[name][0, 0] = float("nan")
    layer = int(name.split(".")[2]) + ps.get_pipeline_model_parallel_rank() * 4 // args.pp
    expert = ps.get_expert_model_parallel_rank() * 8 // args.ep + 1
    assert policy.non_finite() == [f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    args = ap.parse_args()
    initialize_parallel(1, args.pp, seed=0, ep=args.ep, etp=args.etp)
    from megatron.core import parallel_state as ps

    dp_rank, dp_size, rank0 = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), dist.get_rank() == 0
    cfg, model = tiny_qwen3_moe_model(0)
    weights = hf_checkpoint_tensors(model)
    loss_cfg = AlgorithmConfig(loss_agg="seq-mean-token-mean", clip_low=0.2, clip_high=0.28)
    samples, lengths, w_q, _ = make_problem(model, 0.5, 0.5, seed=7)
    denom = losses.full_batch_denominator(
        loss_cfg.loss_agg,
        num_prompts=B,
        group_size=G,
        completion_lengths=lengths,
        prompt_weight=w_q,
        max_response_length=MAX_NEW,
    )
    by_capacity = {}
    for dist_opt in (False, True):
        policies = build_policies(cfg, weights, loss_cfg, args, dist_opt)
        if args.etp > 1:
            # Training at expert-TP 2 needs the dispatcher's all-gather of uneven token counts over
            # the expert-TP group, which gloo refuses (CPU): only the weights' round trip here.
            if rank0:
                print(f"MOE EXPORT CHECK PASSED etp={args.etp}")
            destroy_parallel()
            return
        for capacity in (10_000, 24):  # one micro-batch per rank, then several
            m1, line = check_case(policies, model, (samples, loss_cfg, denom), capacity, dp_rank, dp_size)
            by_capacity.setdefault(capacity, []).append(m1)
            if rank0:
                print(f"ok ep={args.ep} dp={dp_size} recompute={args.recompute} dist_opt={dist_opt} {line}", flush=True)
    assert sum(map(len, by_capacity.values())) == 4
    one, several = by_capacity[10_000][0], by_capacity[24][0]
    assert close(one["moe_z_loss"], several["moe_z_loss"])  # a token mean over the update
    assert not close(one["moe_aux_loss"], several["moe_aux_loss"], 1e-3)  # a Switch loss per micro-batch
    check_non_finite_names(policies[(0.0, 0.0)], ps, args)
    if rank0:
        print("MOE GRAD CHECK PASSED")
    destroy_parallel()


if __name__ == "__main__":
    main()
