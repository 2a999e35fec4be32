"""Worker: sharded HF loading (hf_load.load_hf_into_policy) at one TP/PP layout.

    torchrun --nproc_per_node 2 load_check.py --tp T --pp P --models DIR[,DIR...] --ckpt-root ROOT

For each HF model directory:
  * the policy and its KL reference loaded by load_hf_into_policy equal, tensor for tensor and
    bit for bit, what the whole-checkpoint path gives (every file read whole with safetensors,
    MegatronPolicy.load_hf_state_dict) and what Megatron's own partition attributes cut from the
    full TP=1 state dict (tests/dist/common.shard);
  * this rank read only its share of the bytes (reported, checked by the test);
  * logits of the policy and of the reference equal transformers' (fp32) within 1e-5.
For the first directory, model.init_checkpoint's sequence: save the loaded policy, build a fresh
policy, load_checkpoint(..., load_optimizer=False), copy_policy_to_reference(): policy and
reference equal the saved weights (and the reference did not before the copy).
Rank 0 prints RESULT <json> for every rank.
"""

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "model"))
import common  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

from megatron_dppo.config import AlgorithmConfig, OptimConfig  # noqa: E402
from megatron_dppo.megatron import destroy_parallel, initialize_parallel  # noqa: E402
from megatron_dppo.megatron.checkpoint import load_checkpoint, new_run_id, save_checkpoint, step_dir_name  # noqa: E402
from megatron_dppo.megatron.convert_ckpt import megatron_logits  # noqa: E402
from megatron_dppo.megatron.hf_load import load_hf_into_policy  # noqa: E402
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402
from megatron_dppo.model import qwen3 as mapping  # noqa: E402
from megatron_dppo.model.hf_dir import check_hf_model_dir  # noqa: E402
from megatron_dppo.run.collectives import all_gather_objects  # noqa: E402

TOL = 1e-5


def whole_checkpoint(path: str) -> dict:
    """The old path: every safetensors file of the directory read whole (what trainer.py did)."""
    sd = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            sd.update(load_file(os.path.join(path, name)))
    return sd


def params(module) -> dict:
    return {k: v.detach() for k, v in module.named_parameters()}


def mismatches(a: dict, b: dict) -> list:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def logit_diff(policy_like, hf_dir: str, tokens) -> float:
    logits = megatron_logits(policy_like, tokens)
    diff = torch.zeros(())
    if logits is not None:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            diff = (logits - ref(tokens[None]).logits[0].float()).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def policy(cfg):
    return MegatronPolicy(cfg, OptimConfig(lr=1e-3), AlgorithmConfig(kl_coef=0.1), with_reference=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--models", required=True)
    ap.add_argument("--ckpt-root", required=True)
    args = ap.parse_args()
    initialize_parallel(args.tp, args.pp, seed=0)
    rank = dist.get_rank()
    result = {
        "rank": rank,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "models": {},
    }
    for i, hf_dir in enumerate(args.models.split(",")):
        md = check_hf_model_dir(hf_dir)
        cfg = md.config
        new = policy(cfg)
        stats = load_hf_into_policy(new, md)
        old = policy(cfg)
        whole = whole_checkpoint(hf_dir)
        tied_head = "lm_head.weight" if cfg.tie_word_embeddings else None
        old.load_hf_state_dict({k: v for k, v in whole.items() if k != tied_head})
        full = mapping.hf_to_megatron(whole, new.layout)
        by_attrs = common.shard(new.model.module, full)
        by_attrs = {k: v.to(new.model.module.get_parameter(k).dtype) for k, v in by_attrs.items()}
        tokens = torch.randint(0, cfg.vocab_size, (17,), generator=torch.Generator().manual_seed(i))
        needed = sum(
            md.tensors[n].dtype.itemsize * torch.Size(md.tensors[n].shape).numel()
            for n in mapping.hf_tensor_names(md.layout)
        )
        result["models"][os.path.basename(hf_dir)] = r = {
            "policy_vs_whole": mismatches(params(new.model.module), params(old.model.module)),
            "reference_vs_whole": mismatches(params(new.reference), params(old.reference)),
            "policy_vs_partition_attrs": mismatches(params(new.model.module), by_attrs),
            "tensors": stats["tensors"],
            "bytes_read": stats["bytes_read"],
            "bytes_needed_whole": needed,
            "logit_diff_policy": logit_diff(new, hf_dir, tokens),
            "logit_diff_reference": logit_diff(SimpleNamespace(model=new.reference, hf_config=cfg), hf_dir, tokens),
        }
        assert not (r["policy_vs_whole"] or r["reference_vs_whole"] or r["policy_vs_partition_attrs"]), r
        assert r["logit_diff_policy"] <= TOL and r["logit_diff_reference"] <= TOL, r
        if i == 0:  # model.init_checkpoint: the policy and the reference start from a Megatron checkpoint
            save_checkpoint(args.ckpt_root, 0, new, {"note": "init"}, run_id=new_run_id())
            fresh = policy(cfg)
            load_checkpoint(os.path.join(args.ckpt_root, step_dir_name(0)), fresh, load_optimizer=False)
            saved = params(new.model.module)
            before = len(mismatches(params(fresh.reference), saved))
            copied = fresh.copy_policy_to_reference()
            after = mismatches(params(fresh.reference), saved)
            policy_after = mismatches(params(fresh.model.module), saved)
            with torch.no_grad():  # separate storage: training the policy leaves the reference alone
                next(fresh.model.module.parameters()).add_(1.0)
            still = mismatches(params(fresh.reference), saved)
            result["init_checkpoint"] = {
                "reference_mismatches_before_copy": before,
                "copied": copied,
                "policy_vs_saved": policy_after,
                "reference_vs_saved": after,
                "reference_after_policy_change": still,
            }
            assert before > 0 and copied and not (after or policy_after or still), result["init_checkpoint"]
    # Rank 0 prints every rank's result: two ranks writing to one stream can interleave their lines.
    results = all_gather_objects(result)
    if dist.get_rank() == 0:
        print("".join(f"RESULT {json.dumps(r)}\n" for r in results), end="", flush=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
