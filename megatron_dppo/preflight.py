"""Start-up checks that need more than one key or file, each failing in one line that names them.

`config.validate` checks each key on its own; these check keys against each other and the model
directory's files against each other, before anything slow starts, so that an inconsistency is
named instead of training silently on it (a tokenizer larger than the embedding table) or failing
deep inside a library (vLLM's AssertionError on 21 embedding rows for a 15-token config, its
"The decoder prompt cannot be empty" for a model dir without tokenizer files).
"""

from __future__ import annotations

import os

# Files one of which a Hugging Face tokenizer is built from (fast, BPE, WordPiece, SentencePiece).
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "vocab.txt", "spiece.model")


def check_config(cfg) -> None:
    """Key combinations that cannot run as meant: ValueError naming the keys."""
    a, p = cfg.algorithm, cfg.pruning
    if a.kl_coef > 0 and p.drop_zero_variance:
        raise ValueError(
            f"pruning.drop_zero_variance=true with algorithm.kl_coef={a.kl_coef:g}: a zero-variance group still "
            "has a KL gradient, so dropping it changes the update (it is exact only without KL); set "
            "pruning.drop_zero_variance=false, or leave it unset (it is then on exactly when kl_coef is 0)"
        )


def config_warnings(cfg) -> list[str]:
    """Values that the run ignores, one line each (the caller prints them)."""
    from megatron_dppo.algorithms.pruning import STRATEGIES

    p, out = cfg.pruning, []
    what = {"r_q": "prunes no prompts", "r_o": "prunes no completions"}
    for key in ("r_q", "r_o"):
        value = getattr(p, key)
        if value > 0 and key not in STRATEGIES[p.strategy]().ratios:
            others = sorted(n for n, make in STRATEGIES.items() if key in make().ratios)
            out.append(
                f"warning: pruning.{key}={value:g} is ignored: pruning.strategy={p.strategy} {what[key]} "
                f"(strategies that use pruning.{key}: {', '.join(others)})"
            )
    return out


def check_model(hf_dir: str):
    """model.hf_dir's files, tokenizer and vocabulary, as `train` and `evaluate` both check them
    before anything slow -> (hf_load.HFModelDir, the tokenizer)."""
    from megatron_dppo.megatron.hf_load import check_hf_model_dir

    model_dir = check_hf_model_dir(hf_dir)
    tokenizer = load_tokenizer(hf_dir)
    check_vocab(model_dir, tokenizer)
    return model_dir, tokenizer


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
    the tokenizer (model_dir: hf_load.check_hf_model_dir's result; no tensor is read)."""
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
