"""Worker: MegatronPolicy puts the policy and the KL reference model on the rank's device, and the
path without the distributed optimizer, with a reference model, runs (one process).

    python device_placement_check.py

1. Fake device: the function that picks the device (megatron/model.py's current_device, as
   policy.py calls it) answers the meta device, which nothing is built on. Every parameter and
   buffer of the model handed to the DDP wrapper and of the reference must be there: on a GPU a
   CPU-made router weight or RMSNorm stays on the CPU unless the policy moves it (the wrapper is
   replaced by a recorder: DDP cannot allocate on meta).
2. The real path on CPU, on the tiny MoE (router fp32 weights, local-spec norms):
   parallel.distributed_optimizer=false and a reference model with KL: every tensor is on
   current_device(), the reference's log-probs equal the policy's (same weights), and a train
   step with kl_coef > 0 gives a finite gradient norm and changes the policy, not the reference.
Prints DEVICE PLACEMENT CHECK PASSED.
"""

import math
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
from tiny_models import hf_checkpoint_tensors, tiny_qwen3_moe_model  # noqa: E402

from megatron_dppo.algorithms.packing import Sample, build_thd_batch  # noqa: E402
from megatron_dppo.config import AlgorithmConfig, OptimConfig  # noqa: E402
from megatron_dppo.megatron import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_dppo.megatron import policy as policy_module  # noqa: E402
from megatron_dppo.megatron.model import current_device  # noqa: E402
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402


def misplaced(module: torch.nn.Module, device: torch.device) -> list[str]:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return [f"{name} on {t.device}" for name, t in tensors if t.device.type != device.type]


def fake_device_case(cfg) -> None:
    meta = torch.device("meta")
    wrapped = []

    def record_wrap(model, optim, **kwargs):
        wrapped.append(misplaced(model, meta))
        return SimpleNamespace(module=model), None, None

    pick, wrap = policy_module.current_device, policy_module.wrap_for_training
    policy_module.current_device, policy_module.wrap_for_training = (lambda: meta), record_wrap
    try:
        policy = MegatronPolicy(cfg, OptimConfig(lr=1e-3), AlgorithmConfig(), with_reference=True)
    finally:
        policy_module.current_device, policy_module.wrap_for_training = pick, wrap
    assert wrapped == [[]], f"the model reached the DDP wrapper off the device: {wrapped[0][:5]}"
    assert not misplaced(policy.reference, meta), f"reference off the device: {misplaced(policy.reference, meta)[:5]}"
    print("ok fake device: model and reference moved to current_device() before wrapping", flush=True)


def real_case(cfg, model) -> None:
    dev = current_device()
    algorithm = AlgorithmConfig(kl_coef=0.1)
    policy = MegatronPolicy(cfg, OptimConfig(lr=1e-2), algorithm, with_reference=True, distributed_optimizer=False)
    assert policy.model.ddp_config.use_distributed_optimizer is False
    for name, module in (("policy", policy.model.module), ("reference", policy.reference)):
        assert not misplaced(module, dev), f"{name}: {misplaced(module, dev)[:5]}"
    policy.load_hf_state_dict(hf_checkpoint_tensors(model))
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        tokens = torch.randint(3, cfg.vocab_size, (9 + i,), generator=gen).tolist()
        samples.append(Sample(tokens=tokens, prompt_len=4, advantage=float(torch.randn(1, generator=gen))))
    batch = build_thd_batch(samples)
    logp, ref_logp = policy.compute_logprobs([batch])[0], policy.compute_logprobs([batch], reference=True)[0]
    assert torch.equal(logp, ref_logp), float((logp - ref_logp).abs().max())
    batch.old_logp, batch.ref_logp = logp, ref_logp
    metrics = policy.train_step([batch], denominator=float(batch.loss_mask.sum()))
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0 and metrics["update_ok"], metrics
    after, ref_after = policy.compute_logprobs([batch])[0], policy.compute_logprobs([batch], reference=True)[0]
    assert not torch.equal(after, logp) and torch.equal(ref_after, ref_logp)
    print(f"ok distributed_optimizer=false with a reference: grad_norm={metrics['grad_norm']:.4g}", flush=True)


def main():
    initialize_parallel(1, 1, seed=0)
    cfg, model = tiny_qwen3_moe_model(0)
    fake_device_case(cfg)
    real_case(cfg, model)
    print("DEVICE PLACEMENT CHECK PASSED", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
