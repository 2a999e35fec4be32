"""Start-up checks that need more than one key or file, each failing in one line that names them.

`config.validate` checks each key on its own; these check keys against each other and the model
directory's files against each other, before anything slow starts, so that an inconsistency is
named instead of training silently on it (a tokenizer larger than the embedding table) or failing
deep inside a library (vLLM's AssertionError on 21 embedding rows for a 15-token config, its
"The decoder prompt cannot be empty" for a model dir without tokenizer files).
"""

from __future__ import annotations


def check_config(cfg) -> None:
    """Key combinations that cannot run as meant, and options the trainer does not run yet:
    ValueError naming the keys."""
    a, p = cfg.algorithm, cfg.pruning
    if a.kl_coef > 0 and p.drop_zero_variance:
        raise ValueError(
            f"pruning.drop_zero_variance=true with algorithm.kl_coef={a.kl_coef:g}: a zero-variance group still "
            "has a KL gradient, so dropping it changes the update (it is exact only without KL); set "
            "pruning.drop_zero_variance=false, or leave it unset (it is then on exactly when kl_coef is 0)"
        )


def config_warnings(cfg) -> list[str]:
    """Keys set to other than their default that this config's method does not read
    (config.inert_keys, the one rule), one line each naming the key and why (the caller prints them)."""
    from megatron_dppo.algorithms.losses import recommended_correction
    from megatron_dppo.algorithms.methods import registry
    from megatron_dppo.config import Config, inert_keys

    defaults, out = Config(), []
    for key, why in inert_keys(cfg).items():
        for leaf in _leaf_keys(cfg, key):
            value = _get(cfg, leaf)
            if value != _get(defaults, leaf):
                out.append(f"warning: {leaf}={_show(value)} is ignored: {why}")
    if cfg.parallel.rollout_ranks and cfg.trainer.max_staleness and cfg.algorithm.rollout_correction == "none":
        kind = recommended_correction(cfg.trainer.max_staleness, cfg.rollout.max_new_tokens)
        out.append(
            f"warning: trainer.max_staleness={cfg.trainer.max_staleness} samples with weights an update behind "
            "the trained ones, and algorithm.rollout_correction=none trains on them as if they were the "
            f"trained policy's: consider algorithm.rollout_correction={kind}, the lowest-MSE correction for "
            f"completions of up to rollout.max_new_tokens={cfg.rollout.max_new_tokens} tokens one update behind "
            "(docs/algorithm.md sections 8 and 10)"
        )
    if registry.recipe(cfg.algorithm).aux.enabled and cfg.algorithm.rollout_correction != "none":
        out.append(
            f"note: algorithm.rollout_correction={cfg.algorithm.rollout_correction} weighs the policy-gradient "
            f"term only; the auxiliary term algorithm.aux={cfg.algorithm.aux} (a distillation on the group's "
            "chosen completions, not an expectation over the sampler's tokens) is not reweighted "
            "(docs/algorithm.md section 8)"
        )
    return out


def input_warnings(cfg, tokenizer, hf_config, data_sources) -> list[str]:
    """Keys that do nothing with this model, tokenizer or data, one line each naming the key and why.
    data_sources: the data_source values of the training and validation records."""
    a, out = cfg.algorithm, []
    if not (getattr(hf_config, "num_experts", 0) or 0):
        for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if getattr(a, key):
                out.append(
                    f"warning: algorithm.{key}={getattr(a, key):g} is ignored: model.hf_dir {cfg.model.hf_dir} is a "
                    "dense model (no router)"
                )
        if cfg.rollout.routing_replay:
            out.append(
                f"warning: rollout.routing_replay=true is ignored: model.hf_dir {cfg.model.hf_dir} is a dense model "
                "(no router)"
            )
    read = template_variables(tokenizer.chat_template) if cfg.data.prompt_mode == "chat" else None
    if cfg.data.chat_template_kwargs and read is not None:
        for key in sorted(set(cfg.data.chat_template_kwargs) - read):
            out.append(
                f"warning: data.chat_template_kwargs.{key} is ignored: the chat template of model.hf_dir "
                f"{cfg.model.hf_dir} never reads a variable {key!r} (it reads: {', '.join(sorted(read)) or 'none'})"
            )
    sources = sorted(set(data_sources))
    for src in sorted(set(cfg.reward.by_source) - set(sources)):
        out.append(
            f"warning: reward.by_source.{src} is ignored: no training or validation record has data_source "
            f"{src!r} (the data's sources: {', '.join(repr(s) for s in sources)})"
        )
    from megatron_dppo.algorithms.methods import registry

    out += registry.recipe(a).curriculum.input_warnings(cfg, tokenizer)  # AdaPrefix's step boundaries
    return out


def template_variables(template) -> set[str] | None:
    """The variables a chat template (a jinja string, or a {name: template} mapping) reads from
    its context: jinja2.meta's undeclared variables, what apply_chat_template's kwargs can set.
    Parsed with the extension transformers renders with (loop controls: {% break %}); its own
    {% generation %} tag is a block around assistant text, read as plain content here. None: a
    template this parser cannot read (transformers may still render it: no warning then)."""
    import re

    import jinja2
    import jinja2.meta

    templates = template.values() if isinstance(template, dict) else [template or ""]
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    generation_tags = re.compile(r"{%-?\s*(end)?generation\s*-?%}")
    try:
        parsed = [env.parse(generation_tags.sub("", t)) for t in templates]
    except jinja2.TemplateSyntaxError:
        return None
    return set().union(*(jinja2.meta.find_undeclared_variables(p) for p in parsed))


def _leaf_keys(cfg, key: str) -> list[str]:
    """A dotted key, or every field of the section it names."""
    import dataclasses

    value = _get(cfg, key)
    if dataclasses.is_dataclass(value):
        return [f"{key}.{f.name}" for f in dataclasses.fields(value)]
    return [key]


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _show(value) -> str:
    """A value as a command-line override would write it (0.9, true, 'text')."""
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else repr(value) if isinstance(value, str) else str(value)


# vLLM 0.32's _get_and_verify_max_len: these RoPE types leave max_position_embeddings already scaled.
