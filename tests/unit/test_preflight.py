"""Start-up checks across keys and files (issue 24, item 4): each silent or misleading case becomes
one line naming the keys or files; resume refuses a changed model or fixed setting by name."""

import json
import shutil

import pytest

from megatron_dppo.config import load_config
from megatron_dppo.model.hf_dir import check_vocab, load_tokenizer
from megatron_dppo.run.identity import check_resume_compatible, resume_metadata
from megatron_dppo.train.preflight import check_config, config_warnings

TINY = "examples/tiny/model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def cfg_with(*overrides):
    return load_config("examples/tiny/addition.yaml", list(overrides))


def test_ratios_a_strategy_ignores_are_warned_about():
    assert config_warnings(cfg_with("pruning.strategy=none", "pruning.r_q=0.9", "pruning.r_o=0.9")) == [
        "warning: pruning.r_q=0.9 is ignored: pruning.strategy=none prunes no prompts (strategies that use "
        "pruning.r_q: dppo, greso, greso-simple, reverse)",
        "warning: pruning.r_o=0.9 is ignored: pruning.strategy=none prunes no completions (strategies that use "
        "pruning.r_o: cppo, cppo-group, dppo, reverse)",
    ]
    assert config_warnings(cfg_with("pruning.strategy=dppo", "pruning.r_q=0.9", "pruning.r_o=0.9")) == []
    assert config_warnings(cfg_with("pruning.strategy=none", "pruning.r_q=0", "pruning.r_o=0")) == []


def test_dropping_zero_variance_groups_with_kl_is_refused():
    with pytest.raises(ValueError) as e:
        check_config(cfg_with("algorithm.kl_coef=0.1", "pruning.drop_zero_variance=true"))
    assert str(e.value).startswith(
        "pruning.drop_zero_variance=true with algorithm.kl_coef=0.1: a zero-variance group still has a KL gradient"
    )
    check_config(cfg_with("algorithm.kl_coef=0.1"))  # unset: resolved to off with KL
    check_config(cfg_with("algorithm.kl_coef=0.1", "pruning.drop_zero_variance=false"))
    check_config(cfg_with("pruning.drop_zero_variance=true"))  # exact without KL


def test_dedicated_rollout_ranks_at_staleness_1_without_a_correction_are_warned_about():
    """parallel.rollout_ranks > 0 runs (issue 32); at trainer.max_staleness=1 the samples are an
    update behind, and training on them uncorrected is named at start-up with the kind the MSE table
    of docs/algorithm.md section 8 gives for the run's completion length (losses.RECOMMENDED_CORRECTION:
    seq_tis for short completions, tis for long ones). The disaggregated presets (long completions)
    use what the table gives them and pass the checks."""
    from megatron_dppo.algorithms.losses import LONG_COMPLETION_TOKENS, RECOMMENDED_CORRECTION, recommended_correction

    stale = ("parallel.rollout_ranks=1", "trainer.max_staleness=1")
    (line,) = config_warnings(cfg_with(*stale, "rollout.max_new_tokens=16"))
    assert line.startswith("warning: trainer.max_staleness=1 samples with weights an update behind")
    assert f"consider algorithm.rollout_correction={RECOMMENDED_CORRECTION['staleness']}," in line
    long = cfg_with(*stale, f"rollout.max_new_tokens={LONG_COMPLETION_TOKENS + 1}", "rollout.max_model_len=1024")
    (line,) = config_warnings(long)
    assert f"consider algorithm.rollout_correction={RECOMMENDED_CORRECTION['staleness_long']}," in line
    assert config_warnings(cfg_with(*stale, "algorithm.rollout_correction=seq_tis")) == []
    assert config_warnings(cfg_with("parallel.rollout_ranks=1")) == []  # staleness 0: on-policy
    for preset in ("qwen3_32b_disagg", "qwen3_30b_a3b_disagg"):
        cfg = load_config(f"examples/presets/{preset}.yaml")
        check_config(cfg)
        want = recommended_correction(cfg.trainer.max_staleness, cfg.rollout.max_new_tokens)
        assert cfg.algorithm.rollout_correction == want, (preset, want)


def test_an_auxiliary_term_under_a_correction_is_named_as_not_reweighted():
    """SSOPD's distillation term is outside the rollout correction (issue 44 item 8): said at start-up."""
    on = ("algorithm.aux=ssopd", "algorithm.rollout_correction=tis")
    notes = [w for w in config_warnings(cfg_with(*on)) if w.startswith("note:")]
    assert len(notes) == 1 and "algorithm.aux=ssopd" in notes[0] and "not reweighted" in notes[0], notes
    assert not [w for w in config_warnings(cfg_with("algorithm.aux=ssopd")) if w.startswith("note:")]


def _model_dir(tmp_path, name, vocab, tokenizer_from=TINY):
    """A tiny Qwen3 of `vocab` rows with the main job's 21-token tokenizer files."""
    from tiny_models import tiny_qwen3_model

    _, model = tiny_qwen3_model(0, vocab_size=vocab)
    path = tmp_path / name
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        shutil.copy(f"{tokenizer_from}/{f}", path / f)
    return path


def test_tokenizer_larger_than_the_config_vocabulary_is_refused(tmp_path):
    """The run trained with prompt tokens outside the embedding table, exit 0 (issue 24)."""
    from megatron_dppo.model.hf_dir import check_hf_model_dir

    path = _model_dir(tmp_path, "small-vocab", vocab=15)
    model_dir = check_hf_model_dir(str(path))
    tokenizer = load_tokenizer(str(path))
    with pytest.raises(ValueError) as e:
        check_vocab(model_dir, tokenizer)
    assert str(e.value) == (
        f"the tokenizer of {path} has 21 tokens, more than {path}/config.json's vocab_size 15: token ids from 15 up "
        "would index past the embedding table (use the model's own tokenizer, or a config and weights with a "
        "vocabulary that covers it)"
    )
    check_vocab(check_hf_model_dir(TINY), load_tokenizer(TINY))  # the main job's model is consistent


def test_config_vocabulary_other_than_the_weights_rows_is_refused(tmp_path):
    """config.json says 15 tokens, the safetensors hold 21 rows: vLLM's loader raised a bare
    AssertionError. Found from the header alone."""
    from megatron_dppo.model.hf_dir import check_hf_model_dir

    path = tmp_path / "model"
    shutil.copytree(TINY, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(dict(config, vocab_size=15)))
    with pytest.raises(ValueError) as e:
        check_vocab(check_hf_model_dir(str(path)), load_tokenizer(str(path)))
    assert str(e.value) == (
        f"{path}/config.json says vocab_size 15, but {path}/model.safetensors holds model.embed_tokens.weight with "
        "21 rows: the config and the weights are of different models (fix vocab_size or use the matching weights)"
    )


def test_missing_tokenizer_files_are_named(tmp_path):
    """transformers builds an empty tokenizer from config.json alone: every prompt became [] and vLLM
    said "The decoder prompt cannot be empty"."""
    path = tmp_path / "model"
    shutil.copytree(TINY, path)
    for f in TOKENIZER_FILES:
        (path / f).unlink()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(path))("12+34=").input_ids == []  # what happened before
    with pytest.raises(ValueError) as e:
        load_tokenizer(str(path))
    assert str(e.value) == (
        f"model.hf_dir {path} has no tokenizer files (one of tokenizer.json, vocab.json, tokenizer.model, vocab.txt, "
        "spiece.model): copy the model's tokenizer files into it"
    )
    assert load_tokenizer(TINY)("12+34=").input_ids == [1, 5, 6, 14, 7, 8, 18]


# ---- resume compares what a run cannot change -------------------------------------------------------
def _saved_state(cfg):
    return {"step": 3, "resume": resume_metadata(cfg)}


def test_resume_refuses_a_changed_group_size_or_strategy_by_name():
    saved = _saved_state(cfg_with())
    check_resume_compatible(saved, cfg_with("optim.lr=1e-4", "trainer.max_steps=9"), "ck/step_000003")  # may change
    with pytest.raises(ValueError) as e:
        check_resume_compatible(saved, cfg_with("rollout.group_size=4", "pruning.strategy=greso"), "ck/step_000003")
    assert str(e.value) == (
        "--resume from ck/step_000003: rollout.group_size=4, but the run was trained with 8; pruning.strategy="
        "'greso', but the run was trained with 'dppo'. A run cannot change these mid-way: resume with the run's "
        "values, or start a new run (another trainer.run_name)"
    )
    check_resume_compatible({"step": 3}, cfg_with("rollout.group_size=4"), "ck")  # an older checkpoint: no record


def test_resume_refuses_another_model_but_not_a_copy(tmp_path):
    saved = _saved_state(cfg_with())
    copy = tmp_path / "copy"
    shutil.copytree(TINY, copy)
    check_resume_compatible(saved, cfg_with(f"model.hf_dir={copy}"), "ck")  # moved or copied: the same model
    # Same architecture and tokenizer, other weights (a fine-tune of the same base).
    other = tmp_path / "finetune"
    shutil.copytree(TINY, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(other / "model.safetensors")
    save_file({k: v * 1.001 for k, v in weights.items()}, other / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"model.hf_dir=.*/finetune is not the model the run was trained from .*: "
        r"its weights differ",
    ):
        check_resume_compatible(saved, cfg_with(f"model.hf_dir={other}"), "ck")
    # Another architecture.
    bigger = _model_dir(tmp_path, "bigger", vocab=21)
    with pytest.raises(ValueError) as e:
        check_resume_compatible(saved, cfg_with(f"model.hf_dir={bigger}"), "ck")
    assert "its config.json differs (hidden_size 128 -> 64, num_hidden_layers 3 -> 4, " in str(e.value), str(e.value)


def _inputs(*overrides):
    from transformers import AutoConfig

    cfg = cfg_with(*overrides)
    return cfg, load_tokenizer(TINY), AutoConfig.from_pretrained(TINY)


def test_router_coefficients_on_a_dense_model_are_warned_about():
    from megatron_dppo.train.preflight import input_warnings

    cfg, tok, hf = _inputs("algorithm.moe_aux_loss_coeff=0.01", "algorithm.moe_z_loss_coeff=0.001")
    assert input_warnings(cfg, tok, hf, [""]) == [
        f"warning: algorithm.{k}={v} is ignored: model.hf_dir {TINY} is a dense model (no router)"
        for k, v in (("moe_aux_loss_coeff", "0.01"), ("moe_z_loss_coeff", "0.001"))
    ]
    hf.num_experts = 4  # a MoE model reads them
    assert input_warnings(cfg, tok, hf, [""]) == []


def test_routing_replay_on_a_dense_model_is_warned_about():
    from megatron_dppo.train.preflight import input_warnings

    cfg, tok, hf = _inputs("rollout.routing_replay=true")
    assert input_warnings(cfg, tok, hf, [""]) == [
        f"warning: rollout.routing_replay=true is ignored: model.hf_dir {TINY} is a dense model (no router)"
    ]
    hf.num_experts = 4  # a MoE model replays its routing
    assert input_warnings(cfg, tok, hf, [""]) == []


def test_chat_template_kwargs_the_template_never_reads_are_warned_about():
    """Judged by the variables the jinja template references (the tiny template reads
    enable_thinking): a misspelt one renders the same prompt as none, and is named."""
    from megatron_dppo.data.prompts import PromptRecord, PromptRenderer
    from megatron_dppo.train.preflight import input_warnings

    cfg, tok, hf = _inputs("data.prompt_mode=chat", "data.chat_template_kwargs={enable_thinkin: false}")
    assert input_warnings(cfg, tok, hf, [""]) == [
        f"warning: data.chat_template_kwargs.enable_thinkin is ignored: the chat template of model.hf_dir {TINY} "
        "never reads a variable 'enable_thinkin' (it reads: add_generation_prompt, bos_token, enable_thinking, "
        "messages)"
    ]
    rec = PromptRecord("a", "1+1=", None, "2")
    misspelt = PromptRenderer(tok, "chat", chat_template_kwargs={"enable_thinkin": False}).text(rec)
    assert misspelt == PromptRenderer(tok, "chat").text(rec)  # what makes it a no-op
    cfg, tok, hf = _inputs("data.prompt_mode=chat", "data.chat_template_kwargs={enable_thinking: false}")
    assert input_warnings(cfg, tok, hf, [""]) == []


def test_template_variables_reads_templates_that_transformers_renders():
    """Loop controls ({% break %}, an extension transformers enables) and HF's {% generation %} block
    made jinja2's bare parser raise at start-up, for a warning; unparseable is None (no warning)."""
    from megatron_dppo.train.preflight import template_variables

    template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}{% if think %}<think>{% endif %}"
    )
    assert template_variables(template) == {"messages", "think"}
    assert template_variables({"default": template, "tool_use": "{{ tools }}"}) == {"messages", "think", "tools"}
    assert template_variables("{% if %}") is None


def test_a_by_source_reward_for_no_source_in_the_data_is_warned_about():
    from megatron_dppo.train.preflight import input_warnings

    cfg, tok, hf = _inputs("reward.by_source={addsrc: math, adsrc: math}")
    assert input_warnings(cfg, tok, hf, ["addsrc", "mulsrc", "addsrc"]) == [
        "warning: reward.by_source.adsrc is ignored: no training or validation record has data_source 'adsrc' "
        "(the data's sources: 'addsrc', 'mulsrc')"
    ]


def test_adaprefix_boundaries_no_token_ends_in_are_warned_about():
    """The tiny tokenizer has no "\\n" token: with the default boundaries no prefix is ever cut."""
    from megatron_dppo.train.preflight import input_warnings

    cfg, tok, hf = _inputs("algorithm.curriculum=adaprefix")
    assert input_warnings(cfg, tok, hf, [""]) == [
        f"warning: algorithm.adaprefix.boundaries='\\n' is inert: no token of the tokenizer of model.hf_dir {TINY} "
        "ends in one of these characters, so no prefix is ever cut (name characters its tokens end in)"
    ]
    cfg, tok, hf = _inputs("algorithm.curriculum=adaprefix", "algorithm.adaprefix.boundaries='+='")
    assert input_warnings(cfg, tok, hf, [""]) == []


def test_a_system_prompt_in_raw_mode_is_warned_about():
    assert config_warnings(cfg_with("data.system_prompt=be brief")) == [
        "warning: data.system_prompt='be brief' is ignored: data.prompt_mode=raw applies no chat template, so no "
        "system turn"
    ]
    assert config_warnings(cfg_with("data.system_prompt=be brief", "data.prompt_mode=chat")) == []


def test_a_max_model_len_past_the_model_context_is_named_before_vllm_starts():
    """The tiny model's context is 64 (config.json): 65 was vLLM's pydantic error naming an
    environment variable; the engine now refuses it before vLLM is imported."""
    from megatron_dppo.model.hf_dir import check_context
    from megatron_dppo.rollout.vllm_engine import RolloutEngine

    check_context(64, TINY)
    expected = (
        "config key 'rollout.max_model_len': 65 is more than the model's context, max_position_embeddings 64 in "
        f"{TINY}/config.json: lower rollout.max_model_len to at most 64"
    )
    with pytest.raises(ValueError) as e:
        RolloutEngine(TINY, dtype="float32", max_model_len=65)
    assert str(e.value) == expected


def test_a_warning_writes_the_value_as_an_override_would():
    assert config_warnings(cfg_with("algorithm.reco.renorm=true")) == [
        "warning: algorithm.reco.renorm=true is ignored: algorithm.reweighting=none (algorithm.reco.* act with "
        "algorithm.reweighting=reco)"
    ]


@pytest.mark.parametrize(
    "config_changes, tokenizer_max, allowed",
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}, None, 128),  # transformers 5
        ({"rope_scaling": {"type": "dynamic", "factor": 4.0}}, None, 256),  # before transformers 5
        # yarn (and llama3, longrope): max_position_embeddings is already the scaled context
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}, None, 64),
        ({}, 48, 48),  # the tokenizer's model_max_length caps it
    ],
)
def test_the_context_is_derived_as_vllm_derives_it(tmp_path, config_changes, tokenizer_max, allowed):
    """vLLM 0.32's _get_and_verify_max_len, on the tiny model (max_position_embeddings 64)."""
    from megatron_dppo.model.hf_dir import check_context

    config = json.loads(open(f"{TINY}/config.json").read())
    if "rope_scaling" in config_changes:  # a config written before transformers 5 has no rope_parameters
        config.pop("rope_parameters", None)
    config.update(config_changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if tokenizer_max:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": tokenizer_max}))
    check_context(allowed, str(tmp_path))
    with pytest.raises(ValueError, match=f"rollout.max_model_len': {allowed + 1} is more .* at most {allowed}$"):
        check_context(allowed + 1, str(tmp_path))


def test_partial_rollouts_are_refused_where_not_built_and_warned_about_where_inert():
    """rollout.partial: refused, naming the key, with an engine over several ranks, stop strings or
    routing replay; a warning where no weights arrive mid-round (colocated, or staleness 0)."""
    base = ("parallel.rollout_ranks=1", "trainer.max_staleness=1", "algorithm.rollout_correction=tis")
    for other, why in [
        ("parallel.rollout_tp=2", "false with parallel.rollout_tp > 1"),
        ("rollout.stop=[STOP]", "false with rollout.stop strings"),
        ("rollout.routing_replay=true", "false with rollout.routing_replay=true"),
    ]:
        with pytest.raises(ValueError, match=r"rollout\.partial"):
            try:
                cfg_with(*base, "rollout.partial=true", other)
            except ValueError as e:
                assert why in str(e), str(e)
                raise
    assert config_warnings(cfg_with(*base, "rollout.partial=true")) == []
    (line,) = config_warnings(cfg_with("rollout.partial=true"))
    assert line.startswith("warning: rollout.partial=true is ignored: no new weights arrive during a rollout")
    (line,) = config_warnings(cfg_with("rollout.partial_chunk=8"))
    assert "rollout.partial_chunk=8 is ignored: rollout.partial=false" in line
