"""torchrun --nproc_per_node 1 tests/dist/workers/model/single_worker.py

In its own process because the CPU shim is process-global: the shim is idempotent and lets a
GPTModel train on CPU; the GPTModel equals transformers' Qwen3 (logits, tied and untied);
vocab-parallel log-probs/entropy equal log_softmax over the real vocabulary; bf16 builds;
the attention switch resolves to the local path on CPU."""

import common
import torch
from transformers import Qwen3ForCausalLM

from megatron_dppo.megatron import (
    build_gpt_model,
    cpu_compat,
    enable_cpu_compat,
    initialize_parallel,
    suspend_cpu_compat,
    token_logprobs,
    token_logprobs_and_entropy,
)
from megatron_dppo.megatron.model import resolve_attention_backend


def check_cpu_compat(cfg):
    enable_cpu_compat()
    mode = cpu_compat._MODE
    enable_cpu_compat()  # idempotent: no second mode on the stack
    assert cpu_compat._MODE is mode and mode is not None
    from torch.overrides import _get_current_function_mode_stack

    assert _get_current_function_mode_stack().count(mode) == 1
    assert torch.zeros(1, device="cuda").device.type == "cpu"
    with suspend_cpu_compat():  # lifted inside (vLLM generation runs faster without it)
        assert mode not in _get_current_function_mode_stack()
    assert torch.zeros(1, device="cuda").device.type == "cpu"

    model = build_gpt_model(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, common.VOCAB, (2, 12))
    losses = []
    for _ in range(3):
        opt.zero_grad()
        logits = model(ids, torch.arange(12).expand(2, 12), None)
        loss = -token_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=common.VOCAB).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def hf_to_megatron(hf_model, cfg) -> dict:
    """Full (TP=1) Megatron state dict from HF Qwen3 weights: test-only conversion following
    the table in docs/platform.md section 1 (fused QKV grouped per KV head, fc1 = [gate; up])."""
    sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
    heads, groups, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {
        "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
    }
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = sd[hf + "self_attn.q_proj.weight"].view(groups, heads // groups * dim, -1)
        k = sd[hf + "self_attn.k_proj.weight"].view(groups, dim, -1)
        v = sd[hf + "self_attn.v_proj.weight"].view(groups, dim, -1)
        out[mg + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).flatten(0, 1)
        out[mg + "self_attention.linear_proj.weight"] = sd[hf + "self_attn.o_proj.weight"]
        out[mg + "self_attention.q_layernorm.weight"] = sd[hf + "self_attn.q_norm.weight"]
        out[mg + "self_attention.k_layernorm.weight"] = sd[hf + "self_attn.k_norm.weight"]
        out[mg + "input_layernorm.weight"] = sd[hf + "input_layernorm.weight"]
        out[mg + "pre_mlp_layernorm.weight"] = sd[hf + "post_attention_layernorm.weight"]
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([sd[hf + "mlp.gate_proj.weight"], sd[hf + "mlp.up_proj.weight"]])
        out[mg + "mlp.linear_fc2.weight"] = sd[hf + "mlp.down_proj.weight"]
    return out


def check_matches_hf(cfg):
    torch.manual_seed(0)
    hf_model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF zero-inits nothing we could hide behind: make norms non-trivial
        for name, p in hf_model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = build_gpt_model(cfg).eval()
    common.load_full(model, hf_to_megatron(hf_model, cfg))
    ids = torch.randint(0, common.VOCAB, (2, 17))
    with torch.no_grad(), suspend_cpu_compat():
        ref = hf_model(ids).logits
    causal = torch.ones(17, 17, dtype=torch.bool).triu(1)[None, None]  # True = masked out
    with torch.no_grad():
        logits = model(ids, torch.arange(17).expand(2, 17), None)
        masked = model(ids, torch.arange(17).expand(2, 17), causal)
    assert (logits - masked).abs().max() < 1e-5, "explicit attention_mask path differs"
    err = (logits[..., : common.VOCAB] - ref).abs().max().item()
    print(f"vs transformers (tied={cfg.tie_word_embeddings}): max logit err {err:.2e}")
    assert err < 1e-4, err


def check_logprobs(cfg):
    """Vocab-parallel log-probs / entropy (at TP=1) against a plain log_softmax over the real
    vocabulary, values and gradients, at temperature 0.7; the padded rows (50..127, randomly
    initialised here) must take no probability mass."""
    model = build_gpt_model(cfg)
    ids = torch.randint(0, common.VOCAB, (2, 11))
    logits = model(ids, torch.arange(11).expand(2, 11), None)[:, :-1]
    assert logits.shape[-1] == 128
    leaf = logits.detach().requires_grad_()
    logp, ent = token_logprobs_and_entropy(leaf, ids[:, 1:], vocab_size=common.VOCAB, temperature=0.7)
    (logp.sum() + 0.3 * ent.sum()).backward()
    ref_leaf = logits.detach().requires_grad_()
    ref = torch.log_softmax(ref_leaf[..., : common.VOCAB] / 0.7, -1)
    ref_logp = ref.gather(-1, ids[:, 1:, None])[..., 0]
    ref_ent = -(ref.exp() * ref).sum(-1)
    (ref_logp.sum() + 0.3 * ref_ent.sum()).backward()
    errs = [(logp - ref_logp).abs().max(), (ent - ref_ent).abs().max(), (leaf.grad - ref_leaf.grad).abs().max()]
    print("log-probs/entropy/grad vs log_softmax:", [f"{e:.1e}" for e in errs])
    assert max(errs) < 1e-5, errs
    plain = token_logprobs(logits, ids[:, 1:], vocab_size=common.VOCAB)
    assert torch.allclose(
        plain, torch.log_softmax(logits[..., : common.VOCAB], -1).gather(-1, ids[:, 1:, None])[..., 0], atol=1e-5
    )


def check_bf16(cfg):
    model = build_gpt_model(cfg, params_dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, common.VOCAB, (1, 9))
    logits = model(ids, torch.arange(9)[None], None)
    logp = token_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=common.VOCAB)
    assert logp.dtype == torch.float32 and torch.isfinite(logp).all()
    logp.sum().backward()


def main():
    initialize_parallel(tp=1, pp=1, seed=0)
    assert resolve_attention_backend("auto") == "local"  # no CUDA here
    for bad, err in (("te", ValueError), ("flash", ValueError)):
        try:
            resolve_attention_backend(bad)
            raise AssertionError(f"{bad!r} accepted")
        except err:
            pass
    cfg = common.tiny_config(num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    check_cpu_compat(cfg)
    check_matches_hf(cfg)
    check_matches_hf(common.tiny_config(num_hidden_layers=2, tie_word_embeddings=False))
    check_logprobs(cfg)
    check_bf16(cfg)
    print("OK")


if __name__ == "__main__":
    main()
