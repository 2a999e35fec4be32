"""Worker: the trainer loads a converted checkpoint, takes a step and saves its own checkpoint.

    torchrun --nproc_per_node 2 trainer_ckpt.py --ckpt CONVERTED --root ROOT --ref REF.safetensors --tp 2

1. load_checkpoint(CONVERTED, policy) at this TP/PP, as a resume would call it (the checkpoint
   says model_only, so the optimizer starts fresh); its weights must equal the HF files bit for
   bit (checked here);
2. one DPPO train step (so the optimizer has state), save_checkpoint(ROOT, 1, ...) with model +
   optimizer, and copy hf_config.json into the step dir as the trainer does;
3. rank 0 writes the trained weights (policy.hf_state_dict()) to REF for the Megatron -> HF check.
"""

import argparse
import os
import shutil
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))
from megatron_dppo.algorithms.packing import Sample, build_thd_batch  # noqa: E402
from megatron_dppo.config import AlgorithmConfig, OptimConfig
from megatron_dppo.megatron import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_dppo.megatron.checkpoint import load_checkpoint, new_run_id, save_checkpoint  # noqa: E402
from megatron_dppo.megatron.convert_ckpt import HF_CONFIG, load_hf_config  # noqa: E402
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402
from megatron_dppo.model.hf_io import HFCheckpoint  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    args = ap.parse_args()
    initialize_parallel(args.tp, args.pp, seed=0)
    cfg = load_hf_config(os.path.join(args.ckpt, HF_CONFIG))
    policy = MegatronPolicy(cfg, OptimConfig(lr=1e-2), AlgorithmConfig())
    state = load_checkpoint(args.ckpt, policy)
    assert state["model_only"] and state["step"] == 0

    hf = HFCheckpoint(args.hf_dir)
    loaded = policy.hf_state_dict()
    assert loaded.keys() == {n for n in hf.weight_map if not (cfg.tie_word_embeddings and n == "lm_head.weight")}
    for name, t in loaded.items():
        assert torch.equal(t, hf.get(name)), f"{name} differs after load_checkpoint"

    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, cfg.vocab_size, (12,), generator=gen)
    mb = build_thd_batch([Sample(tokens=tokens, prompt_len=4, advantage=1.0, old_logp=-torch.ones(8))])
    policy.train_step([mb], denominator=8.0)
    save_checkpoint(args.root, 1, policy, {"note": "convert test"}, run_id=new_run_id())
    trained = policy.hf_state_dict()
    if dist.get_rank() == 0:
        shutil.copyfile(os.path.join(args.ckpt, HF_CONFIG), os.path.join(args.root, "step_000001", HF_CONFIG))
        save_file({k: v.contiguous() for k, v in trained.items()}, args.ref)
    destroy_parallel()


if __name__ == "__main__":
    main()
