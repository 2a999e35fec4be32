"""Worker: a converted Qwen3 MoE checkpoint at expert- or tensor-parallel 2, and sharded HF loading.

    torchrun --nproc_per_node 2 moe_ckpt.py --ckpt CONVERTED --hf-dir HF --root ROOT (--ep 2 | --tp 2)

1. the trainer's load_checkpoint(CONVERTED, policy) at this layout: every local tensor of this
   rank (its experts under their local numbers, its TP slices) equals the HF files bit for bit,
   as cut by the in-memory mapping (qwen3.shard_for_rank);
2. hf_load.load_hf_into_models into a fresh model gives the same tensors, reading every dense
   HF tensor and exactly this EP rank's experts: no other rank's expert is read;
3. convert_ckpt.verify_logits (what --verify runs) at this layout: logits against transformers';
4. save_checkpoint(ROOT, 1, policy) at this layout (model + optimizer) and hf_config.json beside
   it as the trainer does, for the Megatron -> HF check of the test. Rank 0 prints RESULT <json>.
"""

import argparse
import json
import os
import shutil
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))
from megatron_dppo.config import AlgorithmConfig, OptimConfig  # noqa: E402
from megatron_dppo.megatron import build_gpt_model, destroy_parallel, initialize_parallel  # noqa: E402
from megatron_dppo.megatron.checkpoint import load_checkpoint, new_run_id, save_checkpoint  # noqa: E402
from megatron_dppo.megatron.convert_ckpt import HF_CONFIG, load_hf_config, verify_logits  # noqa: E402
from megatron_dppo.megatron.hf_load import expert_rank_layout, load_hf_into_models, rank_layout  # noqa: E402
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402
from megatron_dppo.model import qwen3  # noqa: E402
from megatron_dppo.model.hf_io import HFCheckpoint  # noqa: E402
from megatron_dppo.run.collectives import all_gather_objects  # noqa: E402


def expected_local(hf: HFCheckpoint, layout) -> dict:
    tp_rank, tp_size, pp_rank, pp_size = rank_layout()
    ep_rank, ep_size, etp_rank, etp_size = expert_rank_layout()
    full = qwen3.hf_to_megatron({n: hf.get(n) for n in hf.weight_map}, layout)
    return qwen3.shard_for_rank(
        full,
        layout,
        tp_rank,
        tp_size,
        pp_rank,
        pp_size,
        ep_rank=ep_rank,
        ep_size=ep_size,
        etp_rank=etp_rank,
        etp_size=etp_size,
    )


def differing(module, expect: dict) -> list:
    got = {k: v.detach() for k, v in module.named_parameters()}
    assert got.keys() == expect.keys(), sorted(got.keys() ^ expect.keys())[:6]
    return [k for k in got if not torch.equal(got[k], expect[k])]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    args = ap.parse_args()
    initialize_parallel(args.tp, 1, seed=0, ep=args.ep)
    cfg = load_hf_config(os.path.join(args.ckpt, HF_CONFIG))
    policy = MegatronPolicy(cfg, OptimConfig(lr=1e-2), AlgorithmConfig())
    state = load_checkpoint(args.ckpt, policy)
    assert state["model_only"] and state["step"] == 0
    hf = HFCheckpoint(args.hf_dir)
    expect = expected_local(hf, policy.layout)
    result = {"rank": dist.get_rank(), "converted_vs_hf": differing(policy.model.module, expect)}

    fresh = build_gpt_model(cfg)
    stats = load_hf_into_models([fresh], policy.layout, args.hf_dir)
    result["hf_load_vs_hf"] = differing(fresh, expect)
    ep_rank, ep_size, _, _ = expert_rank_layout()
    per = policy.layout.num_experts // ep_size
    read = stats["hf_tensors_read"]
    experts_read = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in read if ".mlp.experts." in n}
    result["experts_read"] = sorted(experts_read)
    result["experts_owned"] = list(range(ep_rank * per, (ep_rank + 1) * per))
    result["dense_unread"] = sorted(n for n in hf.weight_map if ".mlp.experts." not in n and n not in read)

    # The tools' --verify check, here at this layout: logits against transformers'.
    result["logit_diff"] = verify_logits(args.ckpt, args.hf_dir, log=lambda *a: None)
    save_checkpoint(args.root, 1, policy, {"note": "moe convert test"}, run_id=new_run_id())
    if dist.get_rank() == 0:
        shutil.copyfile(os.path.join(args.ckpt, HF_CONFIG), os.path.join(args.root, "step_000001", HF_CONFIG))
    results = all_gather_objects(result)
    if dist.get_rank() == 0:
        for r in results:
            print("RESULT " + json.dumps(r), flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
