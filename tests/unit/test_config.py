"""The run config: one resolution step, named errors, the saved config is the one that ran."""

import dataclasses
import typing

import pytest
import yaml
from tiny_config import FACTS, TINY, TINY_ARCH, TINY_MOE_ARCH

from megatron_dppo.algorithms import choices, losses
from megatron_dppo.algorithms.advantages import ADVANTAGE_KINDS
from megatron_dppo.config import Config, check_layout, load_config, resolve, save_config


def _walk(data, prefix=""):
    for k, v in data.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_saved_config_is_complete(tmp_path):
    """No null, no empty string, no 0 meaning "decide later" in what a run saves; loading the saved
    file back gives the same config."""
    cfg = resolve(load_config(TINY, ["trainer.threads=0", "data.train_size=0"]), **FACTS)
    path = tmp_path / "config.yaml"
    save_config(cfg, path)
    saved = dict(_walk(yaml.safe_load(path.read_text())))
    assert not [k for k, v in saved.items() if v is None or v == ""], saved
    assert saved["optim.decay_steps"] == cfg.trainer.max_steps  # 0 meant "the run's optimizer steps"
    assert saved["trainer.threads"] == 2 and saved["data.train_size"] == 1024
    assert saved["rollout.dtype"] == "float32" and saved["pruning.drop_zero_variance"] is True
    assert saved["parallel.distributed_optimizer"] is False
    assert load_config(str(path)) == cfg


def test_saved_config_shows_only_what_the_method_reads(tmp_path):
    """A GRPO run (strategy none, no KL) saves no pruning ratios and no KL estimator; DPPO keeps both
    ratios, GRESO only r_q, CPPO only r_o; DAPO keeps its resample rounds."""
    cases = {
        "pruning.strategy=none": ({"pruning.r_q", "pruning.r_o", "pruning.history_ema"}, set()),
        "pruning.strategy=dppo": ({"algorithm.kl_estimator"}, {"pruning.r_q", "pruning.r_o"}),
        "pruning.strategy=greso": ({"pruning.r_o"}, {"pruning.r_q", "algorithm.max_resample_rounds"}),
        "pruning.strategy=cppo": ({"pruning.r_q"}, {"pruning.r_o"}),
        "algorithm.dynamic_sampling=true": (set(), {"algorithm.max_resample_rounds"}),
        "algorithm.kl_coef=0.1": ({"algorithm.max_resample_rounds"}, {"algorithm.kl_estimator"}),
    }
    for override, (absent, present) in cases.items():
        cfg = resolve(load_config(TINY, [override, "pruning.r_q=0.5", "pruning.r_o=0.5"]), **FACTS)
        save_config(cfg, tmp_path / "config.yaml")
        saved = set(dict(_walk(yaml.safe_load((tmp_path / "config.yaml").read_text()))))
        assert not absent & saved and present <= saved, (override, absent & saved, present - saved)


def test_unresolved_config_is_not_saved(tmp_path):
    with pytest.raises(ValueError, match="unresolved"):
        save_config(load_config(TINY), tmp_path / "config.yaml")


def test_choices_are_declared_once():
    assert losses.LOSS_AGGS == typing.get_args(choices.LossAgg)
    assert ADVANTAGE_KINDS == typing.get_args(choices.AdvantageKind)
    hints = typing.get_type_hints(type(Config().algorithm))
    assert hints["loss_agg"] is choices.LossAgg


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lr=-1e-5", "'optim.lr': expected a number > 0"),
        ("trainer.max_steps=-1", "'trainer.max_steps': expected an integer >= 1"),
        ("rollout.top_p=0", "'rollout.top_p'"),
        ("algorithm.kl_coef=-0.1", "'algorithm.kl_coef'"),
        ("trainer.save_every=-5", "'trainer.save_every'"),
        ("algorithm.loss_agg=mean", "'algorithm.loss_agg': expected one of"),
        ("pruning.strategy=magic", "'pruning.strategy': expected one of"),
        ("parallel.timeout_minutes=0", "'parallel.timeout_minutes': expected a number of minutes > 0"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(TINY, [override])


def test_scientific_notation_floats_parse(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1e-5\n  min_lr: 1E-7\n" + open(TINY).read().split("optim:")[0])
    cfg = load_config(str(path))
    assert cfg.optim.lr == 1e-5 and cfg.optim.min_lr == 1e-7
    assert load_config(TINY, ["optim.lr=3e-4"]).optim.lr == 3e-4
    with pytest.raises(ValueError, match=r"'optim.lr': expected a finite number \(e.g. 2, 0.5, 1e-3\), got 'fast'"):
        load_config(TINY, ["optim.lr=fast"])


def test_infinity_is_an_untruncated_rollout_correction_cap(tmp_path):
    """Issue 43: algorithm.rollout_correction_cap=inf was "expected float, got 'inf' (str)". Infinity
    (inf on the command line, inf or .inf in YAML) is a cap that truncates nothing, and survives the
    saved config; a key where infinity means nothing, and any other string, say what is allowed."""
    tis = "algorithm.rollout_correction=tis"
    for text in ("inf", ".inf", "+inf", "Infinity"):
        cfg = load_config(TINY, [tis, f"algorithm.rollout_correction_cap={text}"])
        assert cfg.algorithm.rollout_correction_cap == float("inf"), text
    for text in ("inf", ".inf"):  # YAML reads the first as a string, the second as a float
        path = tmp_path / "c.yaml"
        extra = f"algorithm:\n  rollout_correction: tis\n  rollout_correction_cap: {text}\n"
        path.write_text(open(TINY).read().replace("algorithm:\n", extra))
        assert load_config(str(path)).algorithm.rollout_correction_cap == float("inf"), text
    cfg = resolve(load_config(TINY, [tis, "algorithm.rollout_correction_cap=inf"]), **FACTS)
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(str(tmp_path / "config.yaml")).algorithm.rollout_correction_cap == float("inf")
    allowed = "expected a finite number (e.g. 2, 0.5, 1e-3), or inf for untruncated weights"
    for text, got in (("big", "'big' (str)"), ("-inf", "-inf"), (".nan", "nan")):
        with pytest.raises(ValueError) as e:
            load_config(TINY, [tis, f"algorithm.rollout_correction_cap={text}"])
        assert str(e.value) == f"config key 'algorithm.rollout_correction_cap': {allowed}, got {got}"
    for text in ("inf", ".inf"):
        with pytest.raises(ValueError) as e:
            load_config(TINY, [f"optim.lr={text}"])
        assert str(e.value) == "config key 'optim.lr': expected a finite number (e.g. 2, 0.5, 1e-3), got inf"


def test_a_section_written_twice_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(open(TINY).read() + "\noptim:\n  lr: 1.0e-3\n")
    with pytest.raises(ValueError, match=r"c.yaml: line \d+: key 'optim' appears twice"):
        load_config(str(path))


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        ({"tp": 2}, 1, "parallel.tp=2 x parallel.pp=1 must divide the world size 1"),
        ({"tp": 3, "gpus_per_node": 3}, 3, "parallel.tp=3 must divide num_attention_heads"),
        ({"rollout_tp": 3}, 3, "parallel.rollout_tp=3 must divide"),
        ({"tp": 4, "gpus_per_node": 6}, 12, "a tensor-parallel group stays inside a node"),
        ({"pp": 2}, 2, "parallel.pp=2 must divide num_hidden_layers 3"),
    ],
)
def test_layouts_that_do_not_divide_name_the_key(overrides, world, message):
    cfg = load_config(TINY)
    cfg.parallel = dataclasses.replace(cfg.parallel, **overrides)
    with pytest.raises(ValueError, match=message):
        check_layout(cfg, TINY_ARCH, world_size=world)


def test_expert_tensor_parallel_on_cpu_is_refused_naming_the_rule():
    """parallel.etp=2 without EP on 2 processes passed this check, then failed at step 1 inside
    Megatron's token dispatcher: "ProcessGroupGloo::allgather: invalid tensor size at index 1
    (expected (2044, 128), got (1356, 128))" (the tiny MoE model, rerun on 2 CPU processes)."""
    cfg = load_config(TINY, ["parallel.etp=2"])
    moe = dict(model=TINY_MOE_ARCH, world_size=2)
    with pytest.raises(ValueError) as e:
        check_layout(cfg, **moe, cuda=False)
    assert str(e.value) == (
        "invalid parallel layout: parallel.etp=2 cannot run on CPU: Megatron-Core's token dispatcher all-gathers "
        "the expert-TP group's tokens in each rank's own count, which gloo's all_gather refuses (split the experts "
        "with parallel.ep instead, and keep parallel.etp=1)"
    )
    check_layout(cfg, **moe, cuda=True)  # NCCL's all_gather takes per-rank sizes
    check_layout(load_config(TINY, ["parallel.ep=2"]), **moe, cuda=False)
    with pytest.raises(ValueError, match="parallel.etp=2 cannot run on CPU"):  # resolve passes the machine
        resolve(cfg, **{**FACTS, "world_size": 2, "local_world_size": 2, "model": TINY_MOE_ARCH})


def test_vllm_kv_heads_may_be_replicated():
    cfg = load_config(TINY, ["parallel.rollout_tp=4", "parallel.gpus_per_node=4"])
    check_layout(cfg, TINY_ARCH, world_size=4)  # KV heads replicated x2


def test_an_override_below_a_mapping_takes_the_rest_of_the_key_as_one_entry():
    """A data_source with a dot ('my.source'), as an override: one entry of reward.by_source (it
    was read as a section 'my' holding {source: math}: "expected str, got {'source': 'math'}")."""
    cfg = load_config(TINY, ["reward.by_source.my.source=math", "reward.by_source.openai/gsm8k=exact"])
    assert cfg.reward.by_source == {"my.source": "math", "openai/gsm8k": "exact"}
    chat = load_config(TINY, ["data.prompt_mode=chat", "data.chat_template_kwargs.a.b=1"])
    assert chat.data.chat_template_kwargs == {"a.b": 1}
    with pytest.raises(ValueError, match="unknown config key 'reward.by_sourc'"):
        load_config(TINY, ["reward.by_sourc.my.source=math"])
