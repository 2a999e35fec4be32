"""The Llama and Qwen2 families (model/families.py), in process: the HF <-> Megatron name map
round trips bitwise (q/k/v biases fused per KV group, no q/k norms), TP/PP shards merge back,
the parameter counts `plan` uses equal transformers', the refusals name the config.json field,
llama3 RoPE equals transformers' where Megatron-Core's own scaling does not, and the resume
identity tells the RoPE apart. The models against transformers at TP=1, TP=2 and PP=2:
tests/dist/workers/model/families_worker.py."""

import json
import types

import pytest
import torch
from shared_helpers import SMOLLM2_135M, SMOLLM2_135M_ROPE_THETA
from tiny_models import LLAMA3_ROPE, hf_checkpoint_tensors, shard_and_merge, tiny_family_config, tiny_family_model

from megatron_dppo.model import families, qwen3
from megatron_dppo.model.arch import Arch
from megatron_dppo.run import identity

VARIANTS = {
    "llama tied llama3": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama untied": ("llama", dict(tie_word_embeddings=False)),
    "qwen2 tied": ("qwen2", {}),
    "qwen2 untied": ("qwen2", dict(tie_word_embeddings=False)),
}


def _model(variant):
    family, overrides = VARIANTS[variant]
    return tiny_family_model(family, 0, **overrides)


@pytest.mark.parametrize("te_names", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_megatron_hf_is_bitwise(variant, te_names):
    cfg, model = _model(variant)
    sd = hf_checkpoint_tensors(model)
    layout = qwen3.layout_from_hf_config(cfg, padded_vocab=128, te_names=te_names)
    assert not layout.qk_norm and layout.qkv_bias == variant.startswith("qwen2")
    mg = qwen3.hf_to_megatron(sd, layout)
    assert not any("q_layernorm" in k or "k_layernorm" in k for k in mg)
    if layout.qkv_bias:  # fused like the weights: per KV group, its query heads, then k, then v
        b = {n: sd[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv"}
        d = cfg.hidden_size // cfg.num_attention_heads
        expect = torch.cat([b["q"][: 2 * d], b["k"][:d], b["v"][:d], b["q"][2 * d :], b["k"][d:], b["v"][d:]])
        assert torch.equal(mg["decoder.layers.1.self_attention.linear_qkv.bias"], expect)
    back = qwen3.megatron_to_hf(mg, layout)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    assert set(qwen3.hf_tensor_names(layout)) == set(sd)


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_qkv_bias_shards_with_its_kv_groups(tp, pp):
    cfg, model = _model("qwen2 untied")
    layout = qwen3.layout_from_hf_config(cfg, padded_vocab=128 * tp)
    full = qwen3.hf_to_megatron(hf_checkpoint_tensors(model), layout)
    assert qwen3.tp_split_kind("decoder.layers.0.self_attention.linear_qkv.bias") == "column"
    shards, rebuilt = shard_and_merge(full, layout, tp, pp)
    assert rebuilt.keys() == full.keys()
    for k in full:
        assert torch.equal(rebuilt[k], full[k]), k


@pytest.mark.parametrize("variant", VARIANTS)
def test_parameter_counts_equal_transformers(variant):
    """What `plan` counts (model/arch.py: Qwen3's q/k norms absent, Qwen2's biases present)."""
    cfg, model = _model(variant)
    arch = Arch.from_hf(cfg.to_dict())
    assert arch.hf_params() == sum(t.numel() for t in hf_checkpoint_tensors(model).values())


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        (
            "qwen2",
            dict(use_sliding_window=True, max_window_layers=2),
            "config.json use_sliding_window=true (Qwen2ForCausalLM): sliding-window attention is not supported",
        ),
        ("llama", dict(attention_bias=True), "config.json attention_bias=true (LlamaForCausalLM): q/k/v/o biases"),
        ("llama", dict(mlp_bias=True), "config.json mlp_bias=true (LlamaForCausalLM): MLP biases are not mapped"),
        (
            "qwen2",
            dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
            "config.json rope_parameters.rope_type='yarn': Qwen2ForCausalLM is built with 'default' RoPE only",
        ),
        (
            "llama",
            dict(rope_parameters={"rope_type": "linear", "factor": 2.0}),
            "rope_type='linear': LlamaForCausalLM is built with 'default' or 'llama3' RoPE only",
        ),
        (
            "llama",
            dict(architectures=["MistralForCausalLM"]),
            "config.json architectures=['MistralForCausalLM']: only ('Qwen3ForCausalLM', 'Qwen3MoeForCausalLM', "
            "'LlamaForCausalLM', 'Qwen2ForCausalLM') are supported",
        ),
    ],
)
def test_what_the_builder_does_not_carry_is_refused_by_name(family, overrides, message):
    cfg = tiny_family_config(family, **overrides)
    with pytest.raises(ValueError) as e:
        qwen3.layout_from_hf_config(cfg)
    assert message in str(e.value)


def test_llama3_rope_without_a_key_is_refused_by_name():
    cfg = tiny_family_config("llama", rope_parameters=LLAMA3_ROPE)
    del cfg.rope_parameters["low_freq_factor"]
    with pytest.raises(ValueError, match=r"rope_type 'llama3' needs \['low_freq_factor'\]"):
        families.rope_parameters(cfg)


def _inv_freqs(cfg):
    """(transformers', Megatron-Core's RotaryEmbedding(rope_scaling=True)'s, megatron/model.py's)
    inverse frequencies of a llama3-RoPE config."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_dppo.megatron.model import _apply_rope_scaling

    rope = families.rope_parameters(cfg)
    hf, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, torch.device("cpu"))
    d = cfg.head_dim
    kw = dict(kv_channels=d, rotary_percent=1.0, rotary_base=rope["rope_theta"], use_cpu_initialization=True)
    megatron_own = RotaryEmbedding(rope_scaling=True, rope_scaling_factor=rope["factor"], **kw).inv_freq
    ours = types.SimpleNamespace(rotary_pos_emb=RotaryEmbedding(**kw))
    _apply_rope_scaling(ours, cfg)
    return hf, megatron_own, ours.rotary_pos_emb.inv_freq


def test_llama3_rope_equals_transformers_where_megatrons_own_does_not():
    """Megatron-Core 0.16's RotaryEmbedding takes only `factor` from GPTModel and fixes
    low/high_freq_factor 1 / 4 and the original context 8192: at other values (the tiny
    LLAMA3_ROPE) its frequencies are not transformers'; megatron/model.py's are, bit for bit. At
    Llama 3.2's own values (factor 32, 1 / 4 / 8192) both agree."""
    hf, megatron_own, ours = _inv_freqs(tiny_family_config("llama", rope_parameters=LLAMA3_ROPE))
    assert torch.equal(ours, hf)
    assert not torch.allclose(megatron_own, hf, rtol=1e-3)
    llama32 = dict(LLAMA3_ROPE, rope_theta=5e5, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
    llama32["original_max_position_embeddings"] = 8192
    cfg = tiny_family_config("llama", rope_parameters=llama32, head_dim=64, max_position_embeddings=131072)
    hf, megatron_own, ours = _inv_freqs(cfg)
    assert torch.equal(ours, hf) and torch.equal(megatron_own, hf)
    assert not torch.equal(hf, 1.0 / 5e5 ** (torch.arange(0, 64, 2).float() / 64))  # the scaling bites


def test_resume_identity_tells_the_rope_scaling_apart(tmp_path):
    """Two Llama configs alike but for the RoPE are other models; a checkpoint's identity recorded
    before the RoPE fields existed still resumes."""

    def model_dir(name, **overrides):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(tiny_family_config("llama", **overrides).to_json_string())
        return identity.model_identity(str(d))

    plain, scaled = model_dir("plain"), model_dir("scaled", rope_parameters=LLAMA3_ROPE)
    what = identity.model_difference(plain, scaled)
    assert what.startswith("its config.json differs (rope_parameters {") and "'llama3'" in what
    older = dict(plain, architecture={k: v for k, v in plain["architecture"].items() if not k.startswith("rope")})
    assert identity.model_difference(older, plain) == ""
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


# Real models' config.json fields (their model cards) and their published parameter counts.
LLAMA32_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
REAL_SHAPES = {
    "SmolLM2-135M": (
        "llama",
        dict(SMOLLM2_135M, rope_parameters={"rope_type": "default", "rope_theta": SMOLLM2_135M_ROPE_THETA}),
        134_515_008,
    ),
    "Llama-3.2-1B": (
        "llama",
        dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
             intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
             rope_parameters=LLAMA32_ROPE),
        1_235_814_400,
    ),
    "Llama-3.2-3B": (
        "llama",
        dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
             intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=131072,
             rope_parameters=LLAMA32_ROPE),
        3_212_749_824,
    ),
    "Qwen2.5-0.5B": (
        "qwen2",
        dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
             use_sliding_window=False, sliding_window=32768, max_window_layers=21),
        494_032_768,
    ),
    "Qwen2.5-7B": (
        "qwen2",
        dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
             intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, max_position_embeddings=32768,
             use_sliding_window=False, sliding_window=131072, max_window_layers=28,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        7_615_616_512,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", REAL_SHAPES)
def test_real_shapes_are_taken_and_counted_as_published(name):
    """The SmolLM2, Llama-3.2 and Qwen2.5 shapes pass the trainer's check (sliding_window set but
    off, as Qwen2.5's config.json has it), and `plan`'s count equals the published one and
    transformers' (the model built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    family, fields, published = REAL_SHAPES[name]
    cfg = tiny_family_config(family, **fields)
    layout = qwen3.layout_from_hf_config(cfg)
    assert (layout.qk_norm, layout.qkv_bias, layout.tied) == (False, family == "qwen2", fields["tie_word_embeddings"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert Arch.from_hf(cfg.to_dict()).hf_params() == published == sum(p.numel() for p in model.parameters())
