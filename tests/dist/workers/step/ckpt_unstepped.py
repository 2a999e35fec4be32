"""Worker: a checkpoint saved before the optimizer's first update (every step so far skipped
it: no group had a non-zero advantage, so Adam has no state yet) resumes bit for bit.

Three policies from the same weights: `straight` never saves; `saver` saves at step 0 (no update
yet) and goes on; `resumed` loads that checkpoint. Each then trains the same steps 1..2; their
losses, grad norms, learning rates, weights and Adam state (exp_avg, exp_avg_sq, step) must be
equal bit for bit. Writes {"ok": ..., "diffs": [...]} to --out; a failed load prints the error
and exits 3. --dist-opt: with Megatron's DistributedOptimizer (the GPU default).
"""

import argparse
import json
import sys

import torch
import torch.distributed as dist
from ckpt_check import batch_for_step
from grad_check import hf_model

from megatron_dppo.config import AlgorithmConfig, OptimConfig
from megatron_dppo.megatron import destroy_parallel, initialize_parallel
from megatron_dppo.megatron.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_dppo.megatron.policy import MegatronPolicy


def new_policy(cfg, model):
    policy = MegatronPolicy(
        cfg,
        OptimConfig(lr=3e-3, warmup_steps=2, decay_steps=10, decay_style="cosine", weight_decay=0.1),
        AlgorithmConfig(loss_agg="token-mean", clip_high=0.28),
    )
    policy.load_hf_state_dict({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    return policy


def adam_state(policy) -> dict:
    """Every inner torch optimizer's per-parameter state, by (optimizer, parameter) position."""
    inner = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    out = {}
    for i, opt in enumerate(inner):
        params = [p for g in opt.optimizer.param_groups for p in g["params"]]
        for j, p in enumerate(params):
            for key, value in opt.optimizer.state.get(p, {}).items():
                out[f"{i}.{j}.{key}"] = value
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    initialize_parallel(1, 1, seed=0)
    from megatron.core import parallel_state as ps

    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    cfg, model = hf_model()
    straight, saver, resumed = (new_policy(cfg, model) for _ in range(3))
    save_checkpoint(args.ckpt, 0, saver, {"note": "no update yet"}, run_id="unstepped")
    try:
        load_checkpoint(latest_checkpoint(args.ckpt), resumed)
    except CheckpointError as e:
        print(f"CheckpointError: {e}", flush=True)
        sys.exit(3)
    policies = {"straight": straight, "saver": saver, "resumed": resumed}
    diffs = []
    for step in (1, 2):
        mbs, denom = batch_for_step(model, step, dp_rank, dp_size)
        metrics = {name: p.train_step(mbs, denom) for name, p in policies.items()}
        for name in ("saver", "resumed"):
            for key in ("loss", "grad_norm", "lr"):
                if metrics[name][key] != metrics["straight"][key]:
                    diffs.append(f"step {step} {name} {key}: {metrics[name][key]} vs {metrics['straight'][key]}")
    want_w = dict(straight.model.module.named_parameters())
    want_s = adam_state(straight)
    assert want_s, "the reference optimizer has no state after two updates"
    for name in ("saver", "resumed"):
        for key, w in policies[name].model.module.named_parameters():
            if not torch.equal(w, want_w[key]):
                diffs.append(f"{name} weight {key} differs by {(w - want_w[key]).abs().max().item()}")
        have = adam_state(policies[name])
        if sorted(have) != sorted(want_s):
            diffs.append(f"{name} Adam state keys {sorted(set(have) ^ set(want_s))[:4]} differ")
        for key in sorted(set(have) & set(want_s)):
            a, b = have[key], want_s[key]
            if a.dtype != b.dtype or a.device != b.device or not torch.equal(a, b):
                diffs.append(f"{name} Adam state {key}: {a.dtype} {a.flatten()[:2]} vs {b.dtype} {b.flatten()[:2]}")
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"ok": not diffs, "diffs": diffs}, f)
    destroy_parallel()


if __name__ == "__main__":
    main()
