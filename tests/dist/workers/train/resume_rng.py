"""Worker: a resumed Trainer holds the RNG state its checkpoint saved, after vLLM's start-up
(which reseeds the global generators) and the trainer's own seeding.

usage: resume_rng.py CONFIG OVERRIDE...   (the run dir must hold a checkpoint)"""

import os
import sys

import torch
from safetensors.torch import load_file

from megatron_dppo.config import load_config
from megatron_dppo.train.trainer import Trainer


def main():
    cfg = load_config(sys.argv[1], sys.argv[2:])
    trainer = Trainer(cfg, resume=True)
    try:
        ckpt = os.path.join(trainer.ckpt_dir, open(os.path.join(trainer.ckpt_dir, "latest")).read().strip())
        saved = load_file(os.path.join(ckpt, "rng", "rank_0.safetensors"))["cpu"]
        fresh = torch.Generator().manual_seed(cfg.trainer.seed).get_state()
        now = torch.get_rng_state()
        assert not torch.equal(saved, fresh), "the saved state is the seed's: the check could not fail"
        assert torch.equal(now, saved), "the resumed RNG state is not the checkpoint's"
        print("rng restored")
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
