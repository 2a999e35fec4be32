"""Worker: a converted (local-spec) checkpoint loads into a model that asks for TE's `_extra_state`.

    torchrun --nproc_per_node 2 te_extra_state.py --ckpt CONVERTED --hf-dir HF --tp 2

Transformer Engine cannot be built without a GPU, so the TE model is simulated where it differs:
in the TE spec the q/k layernorms and the final layernorm are TE RMSNorms, which carry extra
state (FP8 metadata; an empty uint8 tensor without FP8), where the local spec's torch norms have
none. Giving those modules get_extra_state / set_extra_state makes Megatron's own
sharded_state_dict() request `..._extra_state` ShardedObjects for them, as it does for TE.
1. those keys are requested and absent from the converted checkpoint;
2. plain dist_checkpointing.load fails on them (the problem, confirmed);
3. load_checkpoint loads (sharded_state.fit_to_checkpoint): the weights equal the HF files bit for
   bit and each norm's set_extra_state got its own value back;
4. a truly missing key still fails by name: the same checkpoint (tied embeddings) into an
   untied model, which asks for output_layer.weight.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))
import megatron_dppo.megatron  # noqa: E402, F401  (before megatron.core: imports it without TorchInductor on CPU)

# isort: split
from megatron.core import dist_checkpointing  # noqa: E402

from megatron_dppo.config import AlgorithmConfig, OptimConfig
from megatron_dppo.megatron import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_dppo.megatron.checkpoint import load_checkpoint  # noqa: E402
from megatron_dppo.megatron.convert_ckpt import HF_CONFIG, MODEL_DIR, load_hf_config  # noqa: E402
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402
from megatron_dppo.megatron.sharded_state import checkpoint_keys  # noqa: E402
from megatron_dppo.model.hf_io import HFCheckpoint  # noqa: E402

TE_NORMS = ("q_layernorm", "k_layernorm", "final_layernorm")


def make_te_like(module: torch.nn.Module) -> int:
    """Give the norms TE's RMSNorm has extra state for a get/set_extra_state pair; returns how many."""
    n = 0
    for name, m in module.named_modules():
        if name.split(".")[-1] in TE_NORMS:
            base = type(m)

            class TELikeNorm(base):
                def get_extra_state(self):
                    return torch.zeros(0, dtype=torch.uint8)  # TE without FP8: an empty serialisation

                def set_extra_state(self, state):
                    self.loaded_extra_state = state

            m.__class__ = TELikeNorm
            n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args()
    initialize_parallel(args.tp, 1, seed=0)
    rank0 = dist.get_rank() == 0
    cfg = load_hf_config(os.path.join(args.ckpt, HF_CONFIG))
    model_dir = os.path.join(args.ckpt, MODEL_DIR)

    policy = MegatronPolicy(cfg, OptimConfig(), AlgorithmConfig())
    assert make_te_like(policy.model.module) == 2 * cfg.num_hidden_layers + 1
    requested = policy.model.module.sharded_state_dict()
    extra = sorted({v.key for k, v in requested.items() if k.endswith("layernorm._extra_state")})
    assert extra == [
        "decoder.final_layernorm._extra_state",
        "decoder.layers.self_attention.k_layernorm._extra_state",
        "decoder.layers.self_attention.q_layernorm._extra_state",
    ], extra
    held = checkpoint_keys(model_dir)
    assert not any(k.startswith(tuple(extra)) for k in held), "the converted checkpoint already has them"
    assert any(k.startswith("decoder.layers.self_attention.linear_qkv._extra_state") for k in held)

    try:  # 2. the problem: Megatron's load as load_checkpoint used to call it
        dist_checkpointing.load({"model": requested}, model_dir)
        raise AssertionError("dist_checkpointing.load accepted _extra_state keys the checkpoint lacks")
    except CheckpointException as e:  # torch DCP's; a BaseException, not an Exception
        # the first missing key it names depends on the megatron-core version's key order
        assert any(f"Missing key in checkpoint state_dict: {key}" in str(e) for key in extra), str(e)[:2000]
        if rank0:
            print(
                f"plain dist_checkpointing.load fails: {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True
            )

    # 3. the fix
    state = load_checkpoint(args.ckpt, policy)
    assert state["model_only"]
    hf = HFCheckpoint(args.hf_dir)
    for name, t in policy.hf_state_dict().items():
        assert torch.equal(t, hf.get(name)), f"{name} differs after load_checkpoint"
    norms = [m for n, m in policy.model.module.named_modules() if n.split(".")[-1] in TE_NORMS]
    assert all(m.loaded_extra_state.numel() == 0 for m in norms)
    if rank0:
        print(f"load_checkpoint into the TE-like model: OK ({len(norms)} norms kept their extra state)", flush=True)

    # 4. a truly missing key
    cfg.tie_word_embeddings = False
    untied = MegatronPolicy(cfg, OptimConfig(), AlgorithmConfig())
    try:
        load_checkpoint(args.ckpt, untied)
        raise AssertionError("an untied model loaded a tied checkpoint")
    except ValueError as e:
        assert "output_layer.weight" in str(e) and MODEL_DIR in str(e), str(e)
        if rank0:
            print(f"missing key named: {e}", flush=True)
    if rank0:
        print("TE EXTRA STATE OK", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
