"""What a run cannot change mid-way, recorded in each checkpoint and compared on --resume.

A resumed run must be the run that was saved: the same model (its architecture, tokenizer and
weights: `--resume model.hf_dir=<another model>` resumed without a word) and the settings the
saved state depends on: rollout.group_size (the prompt history's statistics and the advantage
groups) and pruning.strategy (its saved state: another strategy failed with "greso strategy state
is malformed (KeyError('p_easy'))"). `resume_metadata(cfg)` is what the trainer stores with a
checkpoint; `check_resume_compatible(saved, cfg)` refuses a change by name, before anything is
loaded. Everything else (learning rate, max_steps, layouts: checkpoints load at any TP/PP) may
change on resume.

The model is identified without reading its weights: config.json's architecture fields, a hash
of the tokenizer files, and a fingerprint of the safetensors files (their headers, sizes and 64 KiB
read at 8 places in each, the first and the last bytes included: a fine-tune changes every
tensor, so two of one architecture differ there; it costs milliseconds for a 32B model). The
path itself may change (a copy, a moved dir) as long as all three match.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os

from megatron_dppo.model.hf_dir import TOKENIZER_FILES

# Config keys a resumed run must keep (see the module docstring for why each).
# model.lora's shape: the checkpoint holds the adapters of that rank and those targets only.
FIXED_KEYS = ("rollout.group_size", "pruning.strategy", "model.lora.rank", "model.lora.targets", "model.lora.experts")
ARCHITECTURE_FIELDS = (
    "model_type",  # the family (model/families.py): llama, qwen2, qwen3, qwen3_moe
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
    # mixture of experts (absent from a dense config.json: None on both sides)
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "mlp_only_layers",
    "decoder_sparse_step",
    # the family's attention and RoPE (model/families.py): Llama 3.1's llama3 scaling, a theta
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "attention_bias",
)
# The files a tokenizer is built from (preflight's list), and those that change what it produces.
_TOKENIZER_FILES = TOKENIZER_FILES + (
    "tokenizer_config.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
)
_SAMPLES, _SAMPLE_BYTES = 8, 64 << 10


def _get(cfg, key: str):
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _sha(chunks) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c if isinstance(c, bytes) else str(c).encode())
    return h.hexdigest()[:16]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def tokenizer_hash(hf_dir: str) -> str:
    names = [n for n in _TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, n))]
    return _sha(x for n in names for x in (n, _read(os.path.join(hf_dir, n))))


def weights_fingerprint(hf_dir: str) -> str:
    """A hash of each *.safetensors file's name, size, header and 8 evenly spread 64 KiB reads."""
    parts = []
    for path in sorted(glob.glob(os.path.join(hf_dir, "*.safetensors"))):
        size = os.path.getsize(path)
        parts += [os.path.basename(path), size]
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            parts.append(f.read(min(n, size)))
            for k in range(_SAMPLES):  # from the first tensor's bytes to the file's last ones
                f.seek(max(8 + n, (8 + n) + (size - 8 - n - _SAMPLE_BYTES) * k // (_SAMPLES - 1)))
                parts.append(f.read(_SAMPLE_BYTES))
    return _sha(parts)


def model_identity(hf_dir: str) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    return {
        "hf_dir": os.path.realpath(hf_dir),
        "architecture": {k: config.get(k) for k in ARCHITECTURE_FIELDS},
        "tokenizer": tokenizer_hash(hf_dir),
        "weights": weights_fingerprint(hf_dir),
    }


def resume_metadata(cfg) -> dict:
    """What the trainer stores in each checkpoint's trainer state under the key "resume"."""
    return {"settings": {k: _get(cfg, k) for k in FIXED_KEYS}, "model": model_identity(cfg.model.hf_dir)}


def model_difference(saved: dict, current: dict, weights: bool = True) -> str:
    """How the model `current` (model_identity) differs from the saved one, in a phrase ("" when
    it does not): config.json's architecture first, then the tokenizer files, then (weights) the
    weights. A saved identity without a tokenizer or weights hash (from hf_config.json alone)
    compares its architecture only."""
    # A field an older version did not record (absent, not None) is not compared: its checkpoints resume.
    arch = [
        f"{k} {saved['architecture'].get(k)!r} -> {current['architecture'].get(k)!r}"
        for k in ARCHITECTURE_FIELDS
        if k in saved["architecture"] and saved["architecture"][k] != current["architecture"].get(k)
    ]
    if arch:
        return f"its config.json differs ({', '.join(arch)})"
    if saved.get("tokenizer") and saved["tokenizer"] != current["tokenizer"]:
        return "its tokenizer files differ"
    if weights and saved.get("weights") and saved["weights"] != current["weights"]:
        return "its weights differ"
    return ""


def saved_model_identity(state: dict | None, checkpoint: str) -> dict | None:
    """The model a checkpoint was trained from: its trainer state's resume metadata, else (a
    converted checkpoint, an older version's) the architecture of the hf_config.json it carries;
    None when it has neither."""
    model = ((state or {}).get("resume") or {}).get("model")
    if model:
        return model
    path = os.path.join(checkpoint, "hf_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    return {"hf_dir": path, "architecture": {k: config.get(k) for k in ARCHITECTURE_FIELDS}}


def check_checkpoint_model(state: dict | None, cfg, checkpoint: str) -> None:
    """`evaluate --checkpoint`: ValueError when model.hf_dir (whose tokenizer the checkpoint is
    evaluated with) is not the model the checkpoint was trained from: its architecture or tokenizer
    (the weights, trained since, are the checkpoint's own)."""
    saved = saved_model_identity(state, checkpoint)
    if saved is None:
        return
    what = model_difference(saved, model_identity(cfg.model.hf_dir), weights=False)
    if what:
        raise ValueError(
            f"--checkpoint {checkpoint}: model.hf_dir={cfg.model.hf_dir} is not the model the checkpoint was "
            f"trained from ({saved['hf_dir']}): {what}. Set model.hf_dir to that model: its tokenizer and "
            "config are what the checkpoint is evaluated with"
        )


def resume_differences(saved: dict, cfg, current: dict | None = None) -> list[str]:
    """What differs between a checkpoint's resume metadata and cfg, one phrase each. current:
    resume_metadata(cfg) when the caller has it already (it reads the model's files)."""
    current = current or resume_metadata(cfg)
    out = []
    for key, was in saved.get("settings", {}).items():
        now = _get(cfg, key)
        if now != was:
            out.append(f"{key}={now!r}, but the run was trained with {was!r}")
    model = saved.get("model")
    if model:
        what = model_difference(model, current["model"])
        if what:
            out.append(
                f"model.hf_dir={cfg.model.hf_dir} is not the model the run was trained from ({model['hf_dir']}): {what}"
            )
    return out


def check_resume_compatible(saved: dict | None, cfg, checkpoint: str, current: dict | None = None) -> None:
    """ValueError naming each key that a resumed run changed; saved = the checkpoint's trainer
    state (a checkpoint of an older version, without "resume", is not compared); current as in
    resume_differences."""
    meta = (saved or {}).get("resume")
    if not meta:
        return
    diffs = resume_differences(meta, cfg, current)
    if diffs:
        raise ValueError(
            f"--resume from {checkpoint}: " + "; ".join(diffs) + ". A run cannot change these mid-way: resume "
            "with the run's values, or start a new run (another trainer.run_name)"
        )
