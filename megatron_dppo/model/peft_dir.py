"""A PEFT LoRA adapter directory: what `peft`'s `save_pretrained` writes and vLLM's LoRA loader reads.

Two files:
- adapter_config.json: peft_type LORA, r, lora_alpha, lora_dropout, target_modules (Hugging Face
  module names: q_proj, ..., down_proj), base_model_name_or_path, bias "none", task_type CAUSAL_LM,
  and the keys PEFT's LoraConfig would otherwise default differently from a plain LoRA;
- adapter_model.safetensors: `base_model.model.<HF module>.lora_A.weight` [r, in] and
  `.lora_B.weight` [out, r] for every adapted module (PEFT's names, adapter name dropped).

The callers name tensors as the HF model does (`model.layers.0.self_attn.q_proj.lora_A.weight`);
the `base_model.model.` prefix PEFT puts in front is added on write and removed on read.

A version (the trainer's step) may be stamped into the safetensors header's metadata: it travels in
the same file as the tensors, so a reader that finds version N holds version N's tensors
(RolloutEngine.load_adapter refuses a directory whose stamp is not the version it was told).
PEFT and vLLM ignore the metadata. Each file is written to a temporary name in the directory and
renamed over the old one, so a reader never sees half a file. No peft import: this runs in the
trainer and the rollout ranks, where peft is not a dependency.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
VERSION_KEY = "megatron_dppo.version"  # safetensors metadata: the version the tensors belong to

# Our LoRA roles (config model.lora.targets) -> the Hugging Face modules each role adapts.
ROLE_MODULES = {
    "qkv": ["q_proj", "k_proj", "v_proj"],
    "proj": ["o_proj"],
    "fc1": ["gate_proj", "up_proj"],
    "fc2": ["down_proj"],
}
_FACTORS = (".lora_A.weight", ".lora_B.weight")


class PeftDirError(ValueError):
    """An adapter directory, or tensors for one, that cannot be used; one line naming the file or tensor."""


def hf_modules(roles) -> list[str]:
    """The HF module names of LoRA roles, in ROLE_MODULES order (config model.lora.targets -> target_modules)."""
    unknown = [r for r in roles if r not in ROLE_MODULES]
    if unknown:
        raise PeftDirError(f"LoRA role {unknown[0]!r}: expected one of {list(ROLE_MODULES)}")
    return [m for role in ROLE_MODULES if role in roles for m in ROLE_MODULES[role]]


def adapter_config(*, rank: int, alpha: float, dropout: float, target_modules: list[str], base_model: str) -> dict:
    """adapter_config.json's contents: the keys PEFT's LoraConfig and vLLM's PEFTHelper read."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,  # scaling alpha / r, not alpha / sqrt(r)
        "use_dora": False,
        "lora_bias": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
    }


def split_factor_name(name: str) -> tuple[str, str]:
    """'model.layers.0.mlp.up_proj.lora_B.weight' -> ('model.layers.0.mlp.up_proj', 'B')."""
    for suffix in _FACTORS:
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix[6]
    raise PeftDirError(f"LoRA tensor {name!r}: expected a name ending in .lora_A.weight or .lora_B.weight")


def check_adapter_tensors(tensors: dict[str, torch.Tensor], rank: int, target_modules: list[str]) -> None:
    """Every module has an A [rank, in] and a B [out, rank], under a module name in target_modules."""
    if not tensors:
        raise PeftDirError("LoRA tensors: none given (expected lora_A / lora_B weights of the adapted modules)")
    factors: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if name.startswith(PEFT_PREFIX):
            raise PeftDirError(f"LoRA tensor {name!r}: give the HF name without {PEFT_PREFIX!r} (it is added on write)")
        module, factor = split_factor_name(name)
        if module.rsplit(".", 1)[-1] not in target_modules:
            raise PeftDirError(f"LoRA tensor {name!r}: its module is not in target_modules {sorted(target_modules)}")
        if tensor.dim() != 2:
            raise PeftDirError(f"LoRA tensor {name!r}: expected a matrix, got shape {list(tensor.shape)}")
        factors.setdefault(module, {})[factor] = tensor
    for module, pair in sorted(factors.items()):
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise PeftDirError(f"LoRA module {module!r}: has no lora_{missing}.weight")
        if pair["A"].shape[0] != rank or pair["B"].shape[1] != rank:
            raise PeftDirError(
                f"LoRA module {module!r}: expected lora_A [{rank}, in] and lora_B [out, {rank}] (rank {rank}), "
                f"got {list(pair['A'].shape)} and {list(pair['B'].shape)}"
            )


def write_peft_adapter(
    directory,
    tensors: dict[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    dropout: float,
    target_modules: list[str],
    base_model: str,
    version: int | None = None,
) -> Path:
    """Write a PEFT LoRA adapter directory (created if missing) from HF-named A/B tensors; returns it.

    `version` (e.g. the trainer's step) is stamped into the weights file's metadata; a reader of the
    weights file sees the tensors and the stamp of one write. The config is written first and the
    weights last, each atomically, so a reader sees whole files and the weights' stamp says which
    sync they belong to. Files of the directory other than these two are left alone."""
    check_adapter_tensors(tensors, rank, target_modules)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = adapter_config(
        rank=rank, alpha=alpha, dropout=dropout, target_modules=target_modules, base_model=base_model
    )
    _write_atomic(path / ADAPTER_CONFIG, lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))
    # Own contiguous CPU copies: safetensors refuses views sharing memory, and the caller's GPU tensors stay put.
    saved = {PEFT_PREFIX + name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
    metadata = {"format": "pt"}
    if version is not None:
        metadata[VERSION_KEY] = str(int(version))
    _write_atomic(path / ADAPTER_WEIGHTS, lambda tmp: save_file(saved, tmp, metadata=metadata))
    return path


def read_adapter_weights(directory) -> tuple[dict[str, torch.Tensor], int | None]:
    """(tensors under their HF names, the version stamped on write or None), from one read of the weights file."""
    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise PeftDirError(f"{path} is missing: a PEFT adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            raw = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise PeftDirError(f"{path} is not a readable safetensors file ({' '.join(str(e).split())})") from None
    tensors = {}
    for name, tensor in raw.items():
        if not name.startswith(PEFT_PREFIX):
            raise PeftDirError(f"{path}: tensor {name!r} does not start with {PEFT_PREFIX!r} (not a PEFT adapter)")
        tensors[name[len(PEFT_PREFIX) :]] = tensor
    version = metadata.get(VERSION_KEY)
    try:
        return tensors, None if version is None else int(version)
    except ValueError:
        raise PeftDirError(f"{path}: metadata {VERSION_KEY}={version!r} is not an integer") from None


def read_adapter_config(directory) -> dict:
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise PeftDirError(f"{path} is missing: a PEFT adapter directory holds {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PeftDirError(f"{path} is not valid JSON ({e})") from None
    missing = [
        k for k in ("peft_type", "r", "lora_alpha", "target_modules") if not isinstance(config, dict) or k not in config
    ]
    if missing:
        raise PeftDirError(f"{path} has no {missing[0]!r} key (expected a PEFT LoRA adapter_config.json)")
    if config["peft_type"] != "LORA":
        raise PeftDirError(f"{path}: peft_type is {config['peft_type']!r}, expected 'LORA'")
    return config


def read_peft_adapter(directory) -> tuple[dict[str, torch.Tensor], dict]:
    """(the A/B tensors under their HF names, i.e. without 'base_model.model.', the adapter config)."""
    config = read_adapter_config(directory)
    tensors, _ = read_adapter_weights(directory)
    return tensors, config


def _write_atomic(path: Path, write) -> None:
    """write(tmp) into a temporary file beside `path`, then rename it over `path`; the temporary
    file (ours) is removed if the write fails."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
