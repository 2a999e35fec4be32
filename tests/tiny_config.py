"""The tiny config (examples/tiny/addition.yaml) and the facts config.resolve() takes about the model
(examples/tiny/model/config.json, as a model.arch.Arch) and the machine (one CPU process): what the
config tests resolve."""

import dataclasses

from megatron_dppo.model.arch import Arch

TINY = "examples/tiny/addition.yaml"
# examples/tiny/model/config.json's numbers
TINY_ARCH = Arch(vocab=21, hidden=128, layers=3, heads=4, kv_heads=2, head_dim=32, ffn=512, tied=True)
TINY_MOE_ARCH = dataclasses.replace(TINY_ARCH, experts=4, experts_per_tok=2, moe_ffn=64, sparse=(True,) * 3)
FACTS = dict(model=TINY_ARCH, world_size=1, local_world_size=1, num_train_records=1024, cuda=False, threads=2)
