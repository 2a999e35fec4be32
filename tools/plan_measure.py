"""Check `megatron-dppo plan`'s numbers against a real MegatronPolicy on CPU (one process).

  python tools/plan_measure.py            states + saved activations + RSS (a few minutes)
  python tools/plan_measure.py --states   only the exact checks (weights, grads, optimizer)
  torchrun --nproc_per_node 2 tools/plan_measure.py --states --dist-opt    the same at DP=2

1. States, exact: the bytes of the tiny Qwen3's parameters, its DDP fp32 grad buffer and its
   optimizer state (after a step, when Adam has made m and v) against memory_plan's weights,
   gradients and optimizer rows, in float32 and in bfloat16 (fp32 master copy). Exit 1 on a
   mismatch.
2. Activations, exact on CPU: the bytes autograd keeps for backward after a forward + loss
   (saved_tensors_hooks, unique storages, parameters excluded), for 3 and 6 layers, so the
   difference is per layer; per recompute mode. Compared with the plan's per-layer formula,
   which describes the fused GPU path (this CPU path is unfused).
3. Peak RSS growth of a whole train_step for a few token budgets (glibc told to return large
   blocks to the OS, so RSS follows frees), against the plan's activations + logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from functools import partial
from pathlib import Path

# Large blocks through mmap so that freeing them lowers RSS (otherwise RSS only ever grows).
if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    os.execv(sys.executable, [sys.executable] + sys.argv)

import psutil  # noqa: E402
import torch  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_dppo.algorithms.packing import Sample, build_thd_batch  # noqa: E402
from megatron_dppo.config import AlgorithmConfig, Config, OptimConfig
from megatron_dppo.jobs import plan as P  # noqa: E402
from megatron_dppo.megatron import initialize_parallel  # noqa: E402
from megatron_dppo.megatron import policy as step_mod  # noqa: E402  (where MegatronPolicy builds its model)
from megatron_dppo.megatron.policy import MegatronPolicy  # noqa: E402

TINY = REPO / "examples" / "tiny" / "model"
SEQ = 64  # the tiny model's max_position_embeddings


def tiny_hf(layers=3, vocab=None, tied=True) -> tuple[Qwen3Config, dict]:
    if (TINY / "config.json").is_file():
        d = json.loads((TINY / "config.json").read_text())
    else:
        d = dict(
            vocab_size=21,
            hidden_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=512,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    d.update(num_hidden_layers=layers, tie_word_embeddings=tied, layer_types=["full_attention"] * layers)
    if vocab:
        d["vocab_size"] = vocab
    return Qwen3Config(**{k: v for k, v in d.items() if k not in ("architectures", "transformers_version")}), d


def plan_for(d: dict, dtype: str, tmp: Path, recompute="none", T=1024, world=1, dist_opt=False) -> dict:
    (tmp / "config.json").write_text(json.dumps(d))
    cfg = Config()
    cfg.model.hf_dir, cfg.model.dtype = str(tmp), dtype
    cfg.parallel = dataclasses.replace(
        cfg.parallel, nodes=1, gpus_per_node=world, distributed_optimizer=dist_opt, recompute=recompute
    )
    cfg.rollout.max_model_len = SEQ
    cfg.trainer.max_tokens_per_microbatch = T
    return P.memory_plan(cfg, fixes=False)


def storages(tensors) -> dict:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def optimizer_bytes(opt, model) -> int:
    """Bytes the Megatron optimizer owns: Adam state + the params it steps that are not the
    model's own storage (the fp32 master copies of bf16 params, sharded or not)."""
    out = []
    for o in getattr(opt, "chained_optimizers", [opt]):
        inner = o.optimizer
        for state in inner.state.values():
            out += [v for v in state.values() if torch.is_tensor(v) and v.numel() > 1]
        out += [p for group in inner.param_groups for p in group["params"]]
    model_storage = storages(model.parameters())
    return sum(n for ptr, n in storages(out).items() if ptr not in model_storage)


def make_batch(hf, T: int, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(T // SEQ):
        toks = torch.randint(3, hf.vocab_size, (SEQ,), generator=g)
        samples.append(
            Sample(
                tokens=toks,
                prompt_len=8,
                advantage=1.0 if i % 2 else -1.0,
                weight=1.0,
                seq_id=i,
                old_logp=torch.full((SEQ - 8,), -3.0),
            )
        )
    return build_thd_batch(samples)


def check_states(tmp: Path, dist_opt=False, quick=False) -> bool:
    """Plan rows vs tensor bytes on this rank (under torchrun: DP = world size)."""
    world, ok = torch.distributed.get_world_size(), True
    cases = (
        [("bfloat16", torch.bfloat16, False)]
        if quick
        else [
            (n, t, tied)
            for n, t in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
            for tied in (True, False)
        ]
    )
    for dtype, tdtype, tied in cases:
        hf, d = tiny_hf(tied=tied)
        pol = MegatronPolicy(
            hf, OptimConfig(lr=1e-4), AlgorithmConfig(), distributed_optimizer=dist_opt, params_dtype=tdtype
        )
        pol.train_step([make_batch(hf, 256)], denominator=256.0)  # Adam creates m, v at its first step
        params = list(pol.model.module.parameters())
        got = {
            "weights": sum(storages(params).values()),
            "gradients": sum(b.grad_data.numel() * b.grad_data.element_size() for b in pol.model.buffers),
            "optimizer": optimizer_bytes(pol.optimizer, pol.model.module),
        }
        want = plan_for(d, dtype, tmp, world=world, dist_opt=dist_opt)["stages"]["only"]["train"]
        for k, v in got.items():
            # exact, except that the distributed optimizer pads each bucket to a multiple of DP
            match = abs(v - want[k]) <= (0.01 * want[k] if dist_opt else 0)
            ok &= match
            if torch.distributed.get_rank() == 0:
                print(
                    f"states DP={world} dist_opt={dist_opt!s:5s} {dtype:9s} tied={tied!s:5s} {k:10s} "
                    f"measured {v:10d} B  plan {int(want[k]):10d} B  {'ok' if match else 'MISMATCH'}"
                )
        del pol
    return ok


def saved_bytes(pol, batch) -> int:
    """Bytes autograd keeps after forward + loss (unique storages, parameters excluded)."""
    params = storages(pol.model.module.parameters())
    kept = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, loss_fn = pol._forward_step(iter([batch]), pol.model, mode="train", denominator=1000.0)
        loss = loss_fn(out)[0]
    loss.backward()
    return sum(kept.values())


def policy(hf, recompute="none"):
    extra = {
        "none": {},
        "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
        "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    }[recompute]
    orig = step_mod.build_gpt_model
    step_mod.build_gpt_model = partial(orig, **extra)
    try:
        return MegatronPolicy(hf, OptimConfig(lr=1e-5), AlgorithmConfig())
    finally:
        step_mod.build_gpt_model = orig


def check_activations(tmp: Path, T=2048) -> list[dict]:
    rows = []
    for recompute in ("none", "selective", "full"):
        got = {}
        for layers in (3, 6):
            hf, d = tiny_hf(layers)
            got[layers] = saved_bytes(policy(hf, recompute), make_batch(hf, T))
        per_layer = (got[6] - got[3]) / 3 / T
        rest = (got[3] - 3 * per_layer * T) / T
        plan = plan_for(d, "float32", tmp, recompute, T)
        rows.append(
            dict(
                recompute=recompute,
                measured_per_layer_token=per_layer,
                plan_per_layer_token=plan["activation_bytes_per_token_layer"],
                outside_layers_per_token=rest,
            )
        )
        print(
            f"saved activations recompute={recompute:9s}: {per_layer:7.0f} B per layer per token measured, "
            f"plan {plan['activation_bytes_per_token_layer']:6.0f} B (fused GPU path); "
            f"outside the layers {rest:5.0f} B per token"
        )
    # The logits term: a vocabulary big enough to see (8192, padded 8192).
    hf, d = tiny_hf(3, vocab=8192)
    small, _ = tiny_hf(3)
    big, base = saved_bytes(policy(hf), make_batch(hf, T)), saved_bytes(policy(small), make_batch(small, T))
    print(
        f"saved logits: {(big - base) / T / (8192 - 128):.2f} B per token per vocab entry "
        f"(the fp32 softmax the loss keeps: plan's 4 of its dtype + 8)"
    )
    rows.append(dict(logits_saved_bytes_per_token_vocab=(big - base) / T / (8192 - 128)))
    return rows


def peak_rss_growth(fn) -> int:
    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.0005)

    base = proc.memory_info().rss
    th = threading.Thread(target=sample)
    th.start()
    fn()
    done.set()
    th.join()
    return max(peak[0], proc.memory_info().rss) - base


def check_rss(tmp: Path) -> list[dict]:
    rows = []
    for vocab in (None, 8192):
        hf, d = tiny_hf(6, vocab=vocab)
        pol = policy(hf)
        pol.train_step([make_batch(hf, 512)], 512.0)  # optimizer state and first-touch allocations
        for T in (1024, 4096, 16384):
            batch = make_batch(hf, T)
            grow = peak_rss_growth(lambda pol=pol, batch=batch, T=T: pol.train_step([batch], float(T)))
            tr = plan_for(d, "float32", tmp, "none", T)["stages"]["only"]["train"]
            predicted = tr["activations"] + tr["logits"]
            rows.append(dict(vocab=hf.vocab_size, tokens=T, rss_growth=grow, plan_activations_logits=predicted))
            print(
                f"train_step RSS growth vocab={hf.vocab_size:5d} T={T:6d}: {grow / 2**20:8.1f} MiB measured, "
                f"plan activations+logits {predicted / 2**20:8.1f} MiB (ratio {grow / predicted:.2f})"
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--states", action="store_true", help="only the exact state checks")
    ap.add_argument("--quick", action="store_true", help="states: only bf16 untied (the test)")
    ap.add_argument(
        "--dist-opt",
        action="store_true",
        help="states with the distributed optimizer (run under torchrun --nproc_per_node 2 for DP=2)",
    )
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()
    torch.set_num_threads(2)
    initialize_parallel(1, 1)
    import tempfile

    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        ok = check_states(tmp, args.dist_opt, args.quick)
        result = {"states_ok": ok}
        if not args.states:
            result["activations"] = check_activations(tmp)
            result["rss"] = check_rss(tmp)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
