"""HF <-> Megatron-Core GPTModel weight mapping of every supported family (model/families.py:
Qwen3, Qwen3 MoE, Llama, Qwen2), with TP and PP sharding. The families share the HF names;
Qwen3's q/k norms (layout.qk_norm) and Qwen2's q/k/v biases (layout.qkv_bias) are the rows
only some have. (The module keeps its first family's name.)

Plain torch on state dicts (no megatron import), so the conversion tools, the trainer's weight
push to vLLM and the tests share one mapping. Names (measured, docs/platform.md section 1):

  model.embed_tokens.weight                 embedding.word_embeddings.weight   (vocab padded)
  model.layers.L.input_layernorm.weight     decoder.layers.L.input_layernorm.weight
                                            (TE spec: ...self_attention.linear_qkv.layer_norm_weight)
  model.layers.L.self_attn.{q,k,v}_proj     decoder.layers.L.self_attention.linear_qkv.weight
  model.layers.L.self_attn.{q,k,v}_proj.bias  decoder.layers.L.self_attention.linear_qkv.bias (Qwen2)
  model.layers.L.self_attn.{q,k}_norm       decoder.layers.L.self_attention.{q,k}_layernorm.weight (Qwen3)
  model.layers.L.self_attn.o_proj           decoder.layers.L.self_attention.linear_proj.weight
  model.layers.L.post_attention_layernorm   decoder.layers.L.pre_mlp_layernorm.weight
                                            (TE spec: ...mlp.linear_fc1.layer_norm_weight)
  model.layers.L.mlp.{gate,up}_proj         decoder.layers.L.mlp.linear_fc1.weight (gate rows, up rows)
  model.layers.L.mlp.down_proj              decoder.layers.L.mlp.linear_fc2.weight
  model.norm.weight                         decoder.final_layernorm.weight
  lm_head.weight                            output_layer.weight (absent when tied)

The fused QKV rows (and Qwen2's fused bias) are grouped per KV head: for each group g, its
nq/ng query heads, then k head g, then v head g. A TP rank owns whole groups, so a TP split of
linear_qkv is a plain split of dim 0; linear_fc1 must be split gate and up separately.

Qwen3 MoE (Qwen3MoeForCausalLM) sparse layers, expert e of E (megatron/moe.py has the model side):
  model.layers.L.mlp.gate.weight            decoder.layers.L.mlp.router.weight
  model.layers.L.mlp.experts.e.{gate,up}_proj
                                            decoder.layers.L.mlp.experts.local_experts.e.linear_fc1.weight
                                            (TE spec: decoder.layers.L.mlp.experts.linear_fc1.weight<e>)
  model.layers.L.mlp.experts.e.down_proj    ...local_experts.e.linear_fc2.weight (TE: linear_fc2.weight<e>)
  model.layers.L.post_attention_layernorm   decoder.layers.L.pre_mlp_layernorm.weight (both specs)
Global megatron names number experts 0..E-1 (an EP=1 model); an expert-parallel rank r of ep
holds experts [r E/ep, (r+1) E/ep) under local numbers 0..E/ep-1 (to_local_name / to_global_name).
Expert weights are split over the expert-tensor-parallel group (fc1 gate and up apart, fc2 by
columns), not over TP; the router is replicated.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass

import torch

from megatron_dppo.model.families import check_config_keys, check_supported


@dataclass(frozen=True)
class Qwen3Layout:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    padded_vocab: int
    tied: bool
    te_names: bool = False  # Transformer Engine spec fuses the pre-norms into the linears
    num_experts: int = 0  # routed experts per sparse layer; 0: a dense model
    moe_intermediate: int = 0  # each expert's SwiGLU width
    moe_layers: tuple = ()  # per layer: True where the MLP is sparse (empty for a dense model)
    qk_norm: bool = True  # q_norm / k_norm per head (Qwen3); Llama and Qwen2 have none
    qkv_bias: bool = False  # q/k/v biases (Qwen2), fused into linear_qkv.bias as the weights are

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_sparse(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]


def load_hf_config(path: str):
    """A transformers config from a config.json file (hf_config.json in our checkpoints).
    ValueError naming the file for one that is not JSON, has no known model_type, or lacks a key
    a supported family needs (families.check_config_keys)."""
    from transformers import CONFIG_MAPPING

    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: the HF config.json of the model (the trainer copies it into "
            "each checkpoint as hf_config.json; converted checkpoints carry it too)"
        )
    try:
        with open(path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{path}: unknown model_type={model_type!r}")
    config = CONFIG_MAPPING[model_type].from_json_file(path)
    check_config_keys(raw, config, path)  # before a default another model's size is built on
    return config


def read_model_config(path: str):
    """config.json -> (transformers config, Qwen3Layout). The one check of a model's config that
    the trainer (hf_dir.check_hf_model_dir), the converters and `megatron-dppo plan` share, so
    none accepts a model another refuses. ValueError naming the file and the field."""
    config = load_hf_config(path)
    try:
        return config, layout_from_hf_config(config)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(str(e) if path in str(e) else f"{path}: {e}") from None


def moe_layer_pattern(hf_config) -> tuple:
    """Per decoder layer, whether transformers builds it sparse (Qwen3MoeDecoderLayer's rule):
    not in mlp_only_layers and every decoder_sparse_step-th layer; () for a dense model."""
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    if not experts:
        return ()
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers))


def layout_from_hf_config(hf_config, padded_vocab: int | None = None, te_names: bool = False) -> Qwen3Layout:
    """The layout of a supported model; a ValueError naming the config.json field otherwise."""
    family = check_supported(hf_config)  # refuses what this mapping or the GPTModel does not carry
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if hf_config.num_attention_heads % hf_config.num_key_value_heads:
        raise ValueError(
            f"config.json num_attention_heads={hf_config.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={hf_config.num_key_value_heads}"
        )
    return Qwen3Layout(
        num_layers=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads,
        head_dim=head_dim,
        intermediate=hf_config.intermediate_size,
        vocab=hf_config.vocab_size,
        padded_vocab=padded_vocab or hf_config.vocab_size,
        tied=bool(hf_config.tie_word_embeddings),
        te_names=te_names,
        num_experts=int(getattr(hf_config, "num_experts", 0) or 0),
        moe_intermediate=int(getattr(hf_config, "moe_intermediate_size", 0) or 0)
        if moe_layer_pattern(hf_config)
        else 0,
        moe_layers=moe_layer_pattern(hf_config),
        qk_norm=family.qk_norm,
        qkv_bias=family.qkv_bias,
    )


# ---------------------------------------------------------------------------------------------
# Full (unsharded) state dicts, global layer numbering.


def _mg_norm_names(layout: Qwen3Layout, i: int):
    p = f"decoder.layers.{i}."
    # An MoE layer's pre-MLP norm is a module of its own on both specs (no fused fc1).
    ln2 = p + "pre_mlp_layernorm.weight" if layout.is_sparse(i) or not layout.te_names else None
    if layout.te_names:
        return p + "self_attention.linear_qkv.layer_norm_weight", ln2 or p + "mlp.linear_fc1.layer_norm_weight"
    return p + "input_layernorm.weight", ln2


def expert_name(layout: Qwen3Layout, i: int, expert: int, linear: str) -> str:
    """Megatron name of expert `expert`'s linear_fc1 / linear_fc2 in layer i (local spec:
    SequentialMLP's local_experts.e; TE spec: TEGroupedMLP's weight<e>)."""
    p = f"decoder.layers.{i}.mlp.experts."
    return f"{p}{linear}.weight{expert}" if layout.te_names else f"{p}local_experts.{expert}.{linear}.weight"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Qwen3Layout) -> torch.Tensor:
    ng, hpg, d = layout.num_kv_heads, layout.heads_per_group, layout.head_dim
    rest = q.shape[1:]
    q = q.reshape(ng, hpg * d, *rest)
    k = k.reshape(ng, d, *rest)
    v = v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(ng * (hpg + 2) * d, *rest)


def split_qkv(qkv: torch.Tensor, layout: Qwen3Layout):
    ng, hpg, d = layout.num_kv_heads, layout.heads_per_group, layout.head_dim
    rest = qkv.shape[1:]
    g = qkv.reshape(ng, (hpg + 2) * d, *rest)
    q, k, v = g.split([hpg * d, d, d], dim=1)
    return (q.reshape(ng * hpg * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest))


def _pad_vocab(w: torch.Tensor, layout: Qwen3Layout) -> torch.Tensor:
    if w.shape[0] == layout.padded_vocab:
        return w
    pad = w.new_zeros(layout.padded_vocab - w.shape[0], *w.shape[1:])
    return torch.cat([w, pad], dim=0)


def _same(t):
    return t


def _gate_up(gate, up):
    return torch.cat([gate, up], 0)


def _mlp_rules(i: int, layout: Qwen3Layout) -> dict:
    h, p = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    if not layout.is_sparse(i):
        return {
            p + "linear_fc1.weight": ((h + "gate_proj.weight", h + "up_proj.weight"), _gate_up),
            p + "linear_fc2.weight": ((h + "down_proj.weight",), _same),
        }
    rules = {p + "router.weight": ((h + "gate.weight",), _same)}
    for e in range(layout.num_experts):
        x = f"{h}experts.{e}."
        rules[expert_name(layout, i, e, "linear_fc1")] = ((x + "gate_proj.weight", x + "up_proj.weight"), _gate_up)
        rules[expert_name(layout, i, e, "linear_fc2")] = ((x + "down_proj.weight",), _same)
    return rules


@functools.lru_cache(maxsize=8)  # the streaming paths ask for one layer's table once per tensor
def _layer_rules(i: int, layout: Qwen3Layout) -> dict:
    """megatron name -> (the HF names it is built from, how to build it), for layer i. One table
    serves the whole-layer conversion and the tensor-at-a-time streaming converter."""
    h, p = f"model.layers.{i}.", f"decoder.layers.{i}."
    ln1, ln2 = _mg_norm_names(layout, i)
    a, q = h + "self_attn.", p + "self_attention."
    same = _same
    fuse = lambda q, k, v: fuse_qkv(q, k, v, layout)  # noqa: E731
    rules = {
        ln1: ((h + "input_layernorm.weight",), same),
        q + "linear_qkv.weight": ((a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), fuse),
    }
    if layout.qkv_bias:
        rules[q + "linear_qkv.bias"] = ((a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), fuse)
    if layout.qk_norm:
        rules[q + "q_layernorm.weight"] = ((a + "q_norm.weight",), same)
        rules[q + "k_layernorm.weight"] = ((a + "k_norm.weight",), same)
    rules[q + "linear_proj.weight"] = ((a + "o_proj.weight",), same)
    rules[ln2] = ((h + "post_attention_layernorm.weight",), same)
    return {**rules, **_mlp_rules(i, layout)}


def _global_rules(layout: Qwen3Layout) -> dict:
    pad = lambda w: _pad_vocab(w, layout)  # noqa: E731
    rules = {
        "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), pad),
        "decoder.final_layernorm.weight": (("model.norm.weight",), lambda t: t),
    }
    if not layout.tied:
        rules["output_layer.weight"] = (("lm_head.weight",), pad)
    return rules


def hf_layer_to_megatron(i: int, get, layout: Qwen3Layout) -> dict:
    """One decoder layer. get(hf_name) -> tensor. Returns megatron names (global index i)."""
    return {name: build(*map(get, srcs)) for name, (srcs, build) in _layer_rules(i, layout).items()}


def megatron_tensor_from_hf(name: str, get, layout: Qwen3Layout) -> torch.Tensor:
    """One megatron tensor (global name, TP=1 layout, vocab padded) from the HF tensors it needs:
    the streaming converter reads only those."""
    m = _LAYER.match(name)
    rules = _layer_rules(int(m.group(1)), layout) if m else _global_rules(layout)
    if name not in rules:
        raise KeyError(f"no HF source for megatron tensor {name!r}")
    srcs, build = rules[name]
    return build(*map(get, srcs))


def hf_tensor_names(layout: Qwen3Layout) -> list:
    """Every HF tensor the mapping reads (to check a checkpoint before converting it)."""
    names = [n for srcs, _ in _global_rules(layout).values() for n in srcs]
    for i in range(layout.num_layers):
        names += [n for srcs, _ in _layer_rules(i, layout).values() for n in srcs]
    return names


def hf_tensor_shape(name: str, layout: Qwen3Layout) -> tuple:
    """(shape, the config.json keys that set it) of an HF tensor the mapping reads, as
    transformers builds it from the config (embedding and head rows: vocab_size)."""
    h, d, v = layout.hidden, layout.head_dim, layout.vocab
    q, kv = layout.num_heads * d, layout.num_kv_heads * d
    q_keys, kv_keys = ("num_attention_heads", "head_dim"), ("num_key_value_heads", "head_dim")
    expert = ".experts." in name
    mlp = (layout.moe_intermediate, "moe_intermediate_size") if expert else (layout.intermediate, "intermediate_size")
    rules = (
        (("embed_tokens.weight", "lm_head.weight"), (v, h), ("vocab_size", "hidden_size")),
        (("layernorm.weight", "model.norm.weight"), (h,), ("hidden_size",)),
        (("q_norm.weight", "k_norm.weight"), (d,), ("head_dim",)),
        (("q_proj.weight",), (q, h), (*q_keys, "hidden_size")),
        (("q_proj.bias",), (q,), q_keys),
        (("k_proj.weight", "v_proj.weight"), (kv, h), (*kv_keys, "hidden_size")),
        (("k_proj.bias", "v_proj.bias"), (kv,), kv_keys),
        (("o_proj.weight",), (h, q), ("hidden_size", *q_keys)),
        (("mlp.gate.weight",), (layout.num_experts, h), ("num_experts", "hidden_size")),
        (("gate_proj.weight", "up_proj.weight"), (mlp[0], h), (mlp[1], "hidden_size")),
        (("down_proj.weight",), (h, mlp[0]), ("hidden_size", mlp[1])),
    )
    for suffixes, shape, keys in rules:
        if name.endswith(suffixes):
            return shape, keys
    raise KeyError(f"no shape rule for HF tensor {name!r}")


def _megatron_mlp_to_hf(i: int, get, layout: Qwen3Layout) -> dict:
    h, p = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    if not layout.is_sparse(i):
        gate, up = get(p + "linear_fc1.weight").chunk(2, dim=0)
        return {
            h + "gate_proj.weight": gate.contiguous(),
            h + "up_proj.weight": up.contiguous(),
            h + "down_proj.weight": get(p + "linear_fc2.weight"),
        }
    out = {h + "gate.weight": get(p + "router.weight")}
    for e in range(layout.num_experts):
        gate, up = get(expert_name(layout, i, e, "linear_fc1")).chunk(2, dim=0)
        x = f"{h}experts.{e}."
        out[x + "gate_proj.weight"] = gate.contiguous()
        out[x + "up_proj.weight"] = up.contiguous()
        out[x + "down_proj.weight"] = get(expert_name(layout, i, e, "linear_fc2"))
    return out


def megatron_layer_to_hf(i: int, get, layout: Qwen3Layout) -> dict:
    h, p = f"model.layers.{i}.", f"decoder.layers.{i}."
    ln1, ln2 = _mg_norm_names(layout, i)
    a, s = h + "self_attn.", p + "self_attention."
    out = {h + "input_layernorm.weight": get(ln1)}
    for kind in ("weight", "bias") if layout.qkv_bias else ("weight",):
        qkv = split_qkv(get(f"{s}linear_qkv.{kind}"), layout)
        out.update(zip((f"{a}{n}_proj.{kind}" for n in "qkv"), qkv))
    if layout.qk_norm:
        out[a + "q_norm.weight"] = get(s + "q_layernorm.weight")
        out[a + "k_norm.weight"] = get(s + "k_layernorm.weight")
    out[a + "o_proj.weight"] = get(s + "linear_proj.weight")
    out[h + "post_attention_layernorm.weight"] = get(ln2)
    return {**out, **_megatron_mlp_to_hf(i, get, layout)}


def _getter(sd: dict, what: str):
    def get(name):
        if name not in sd:
            raise KeyError(f"{what} state dict has no tensor {name!r}")
        return sd[name]

    return get


def hf_to_megatron(hf_sd: dict, layout: Qwen3Layout) -> dict:
    get = _getter(hf_sd, "HF")
    out = {name: build(*map(get, srcs)) for name, (srcs, build) in _global_rules(layout).items()}
    for i in range(layout.num_layers):
        out.update(hf_layer_to_megatron(i, get, layout))
    return out


def _global_to_hf(layout: Qwen3Layout) -> dict:
    """HF name -> (megatron name, how): the tensors outside the decoder layers (vocab padding cut)."""
    trim = lambda w: w[: layout.vocab].contiguous()  # noqa: E731
    rules = {
        "model.embed_tokens.weight": ("embedding.word_embeddings.weight", trim),
        "model.norm.weight": ("decoder.final_layernorm.weight", lambda t: t),
    }
    if not layout.tied:
        rules["lm_head.weight"] = ("output_layer.weight", trim)
    return rules


def global_hf_sources(layout: Qwen3Layout) -> dict:
    """HF name -> the megatron name it comes from, for the tensors outside the decoder layers."""
    return {hf: mg for hf, (mg, _) in _global_to_hf(layout).items()}


def megatron_globals_to_hf(get, layout: Qwen3Layout, hf_names=None) -> dict:
    """The non-layer HF tensors (or only hf_names of them) from megatron tensors via get."""
    rules = _global_to_hf(layout)
    return {hf: fn(get(mg)) for hf, (mg, fn) in rules.items() if hf_names is None or hf in hf_names}


def megatron_to_hf(mg_sd: dict, layout: Qwen3Layout) -> dict:
    get = _getter(mg_sd, "Megatron")
    out = megatron_globals_to_hf(get, layout)
    for i in range(layout.num_layers):
        out.update(megatron_layer_to_hf(i, get, layout))
    return out


# ---------------------------------------------------------------------------------------------
# Tensor- and pipeline-parallel sharding of megatron names.

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
# An expert's tensor: SequentialMLP's local_experts.<e>.<rest> or TEGroupedMLP's linear_fc<n>.weight<e>.
_EXPERT = re.compile(
    r"^(?P<pre>.*\.mlp\.experts\.)(?:local_experts\.(?P<seq>\d+)\.(?P<rest>.+)|(?P<te>linear_fc[12]\.weight)(?P<tenum>\d+))$"
)


def layer_index(name: str):
    """The layer number of a global megatron name (decoder.layers.L.*), or None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def expert_index(name: str):
    """The expert number in a megatron expert tensor's name, or None for any other tensor."""
    m = _EXPERT.match(name)
    return None if m is None else int(m.group("seq") if m.group("seq") is not None else m.group("tenum"))


def is_expert(name: str) -> bool:
    """A routed expert's tensor (numbered over EP, split over expert-TP), not a dense one."""
    return expert_index(name) is not None


def split_group(name: str, tp_size: int, etp_size: int, tp_rank: int = 0, etp_rank: int = 0) -> tuple[int, int]:
    """(rank, size) of the group a megatron tensor is split over (tp_shard / tp_merge): an expert's
    over expert-TP, Megatron's expert_tensor_parallel group, never over TP; any other over TP."""
    return (etp_rank, etp_size) if is_expert(name) else (tp_rank, tp_size)


def with_expert_index(name: str, expert: int) -> str:
    """The same expert tensor's name with another expert number (global <-> EP-local)."""
    m = _EXPERT.match(name)
    if m.group("seq") is not None:
        return f"{m.group('pre')}local_experts.{expert}.{m.group('rest')}"
    return f"{m.group('pre')}{m.group('te')}{expert}"


def tp_split_kind(name: str) -> str:
    """How a megatron tensor is split over TP ranks (an expert's: over expert-TP ranks):
    row/column/fc1/vocab/replicated."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return "vocab"
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        return "column"
    if re.search(r"linear_fc1\.weight\d*$", name):
        return "fc1"
    if re.search(r"(linear_proj\.weight|linear_fc2\.weight\d*)$", name):
        return "row"
    return "replicated"


def tp_shard(name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    kind = tp_split_kind(name)
    if tp_size == 1 or kind == "replicated":
        return full
    if kind in ("vocab", "column"):
        return full.chunk(tp_size, dim=0)[tp_rank].contiguous()
    if kind == "row":
        return full.chunk(tp_size, dim=1)[tp_rank].contiguous()
    gate, up = full.chunk(2, dim=0)
    return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)


def tp_merge(name: str, shards: list) -> torch.Tensor:
    kind = tp_split_kind(name)
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind in ("vocab", "column"):
        return torch.cat(shards, dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    if num_layers % pp_size:
        raise ValueError(f"num_layers={num_layers} is not divisible by pipeline parallel size {pp_size}")
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def _experts_per_rank(num_experts: int, ep_size: int) -> int:
    if num_experts % ep_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by expert parallel size {ep_size}")
    return num_experts // ep_size


def to_local_name(name: str, pp_rank: int, pp_size: int, num_layers: int, *, ep_rank=0, ep_size=1, num_experts=0):
    """Global megatron name -> this rank's local name, or None when another stage (or, for an
    expert, another expert-parallel rank) owns it."""
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    m = _LAYER.match(name)
    if m:
        layers = stage_layers(num_layers, pp_rank, pp_size)
        i = int(m.group(1))
        if i not in layers:
            return None
        local = f"decoder.layers.{i - layers.start}.{m.group(2)}"
        e = expert_index(local)
        if e is None or ep_size == 1:
            return local
        per = _experts_per_rank(num_experts, ep_size)
        return with_expert_index(local, e - ep_rank * per) if e // per == ep_rank else None
    if name.startswith("embedding."):
        return name if first else None
    if name.startswith(("decoder.final_layernorm", "output_layer")):
        return name if last else None
    return name


def to_global_name(local: str, pp_rank: int, pp_size: int, num_layers: int, *, ep_rank=0, ep_size=1, num_experts=0):
    m = _LAYER.match(local)
    if not m:
        return local
    start = stage_layers(num_layers, pp_rank, pp_size).start
    name = f"decoder.layers.{int(m.group(1)) + start}.{m.group(2)}"
    e = expert_index(name)
    if e is None or ep_size == 1:
        return name
    return with_expert_index(name, ep_rank * _experts_per_rank(num_experts, ep_size) + e)


def shard_for_rank(
    full_mg: dict,
    layout: Qwen3Layout,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    pp_size: int,
    *,
    ep_rank: int = 0,
    ep_size: int = 1,
    etp_rank: int = 0,
    etp_size: int = 1,
) -> dict:
    """The local state dict one (tp, pp, ep, expert-tp) rank holds, from a full megatron state dict."""
    out = {}
    for name, tensor in full_mg.items():
        local = to_local_name(
            name, pp_rank, pp_size, layout.num_layers, ep_rank=ep_rank, ep_size=ep_size, num_experts=layout.num_experts
        )
        if local is not None:
            out[local] = tp_shard(name, tensor, *split_group(name, tp_size, etp_size, tp_rank, etp_rank))
    if layout.tied and pp_size > 1 and pp_rank == pp_size - 1:
        # The last stage holds its own copy of the tied embedding as output_layer.weight.
        out["output_layer.weight"] = tp_shard(
            "output_layer.weight", full_mg["embedding.word_embeddings.weight"], tp_rank, tp_size
        )
    return out


def hf_model_tensors(model, grads: bool = False) -> dict:
    """A transformers Qwen3 / Qwen3-MoE model's weights (or gradients) under the names its
    safetensors files use (what hf_to_megatron and load_hf_state_dict take): transformers 5 holds
    each layer's experts as 3-D gate_up_proj [E, 2I, H] (gate rows, then up) and down_proj
    [E, H, I], and writes them per expert (mlp.experts.<e>.{gate,up,down}_proj.weight); a tied
    lm_head is not written."""
    out = {}
    for name, p in model.named_parameters():
        t = (p.grad if grads else p).detach()
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, (gate, up) in enumerate(x.chunk(2, dim=0) for x in t):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif name.endswith("mlp.experts.down_proj"):
            for e, x in enumerate(t):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = x
        elif not (model.config.tie_word_embeddings and name == "lm_head.weight"):
            out[name] = t
    return out
