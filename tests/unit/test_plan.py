"""`megatron-dppo plan`: byte counts against real models, the presets fit, bad layouts are refused."""

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from shared_helpers import SMOLLM2_135M_CONFIG_JSON

from megatron_dppo.config import check_layout, layout_choices, load_config
from megatron_dppo.jobs.plan import (
    Arch,
    format_plan,
    layer_activation_elems,
    load_hf_config,
    memory_plan,
    plan_main,
    sync_peak_bytes,
)
from megatron_dppo.model.vocab import padded_vocab_size

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny" / "model"
QWEN3_32B = REPO / "examples" / "qwen3_32b" / "config.yaml"
PRESETS = sorted((REPO / "examples" / "presets").glob("*.yaml"))
MOE_PRESETS = {"qwen3_30b_a3b", "qwen3_235b_a22b"}
# Dedicated rollout ranks (plan only, the trainer refuses them): tests/unit/test_plan_disagg.py.
DISAGG_PRESETS = {"qwen3_32b_disagg", "qwen3_30b_a3b_disagg"}
# The founding paper's Table 9 settings (GRPO and DAPO on MATH with DPPO): model -> config dir, GPUs.
TABLE9 = {
    "qwen2.5_7b": ("qwen2.5_configs/7B-Instruct", 8),
    "llama3.2_3b": ("llama3.2_configs/3B-Instruct", 8),
    "qwen2.5_32b": ("qwen2.5_configs/32B-Instruct", 32),
}
TABLE9_PRESETS = [REPO / "examples" / "presets" / f"{m}_{a}.yaml" for m in TABLE9 for a in ("grpo", "dapo")]
SHIPPED = sorted((REPO / "examples").glob("**/*.yaml"))
SIZES = ["0.6B", "1.7B", "4B", "8B", "14B", "32B"]


def _trainer_check(cfg, hf: dict, world: int) -> None:
    """config.check_layout called as the trainer calls it, with the facts of config.json `hf`."""
    check_layout(cfg, Arch.from_hf(hf), world_size=world)


def _cfg(path=QWEN3_32B, *overrides):
    return load_config(str(path) if path else None, list(overrides), check=False)


def _tiny_cfg(tmp_path, tied=True, dtype="float32"):
    d = json.loads((TINY / "config.json").read_text())
    d["tie_word_embeddings"] = tied
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg = _cfg(
        None,
        f"model.hf_dir={tmp_path}",
        f"model.dtype={dtype}",
        "parallel.nodes=1",
        "parallel.gpus_per_node=1",
        "rollout.max_model_len=64",
        "trainer.max_tokens_per_microbatch=1024",
    )
    return cfg, d


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype, nbytes", [("float32", 4), ("bfloat16", 2)])
def test_weight_bytes_equal_the_real_model_plus_vocab_padding(tmp_path, tied, dtype, nbytes):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg, d = _tiny_cfg(tmp_path, tied, dtype)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**d)).to(getattr(torch, dtype))
    hf_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # ties counted once
    plan = memory_plan(cfg)
    pad_rows = padded_vocab_size(d["vocab_size"], 1) - d["vocab_size"]  # 21 -> 128
    assert pad_rows == 107
    extra = pad_rows * d["hidden_size"] * (1 if tied else 2) * nbytes
    assert plan["stages"]["only"]["train"]["weights"] == hf_bytes + extra
    assert plan["stages"]["only"]["train"]["gradients"] == (hf_bytes + extra) // nbytes * 4  # fp32 main_grad
    per_param = 8 if dtype == "float32" else 12  # Adam m, v (+ fp32 master copy for bf16)
    assert plan["stages"]["only"]["train"]["optimizer"] == (hf_bytes + extra) // nbytes * per_param


@pytest.mark.parametrize("size", SIZES)
def test_qwen3_configs_have_the_published_sizes(size):
    """Parameter counts of the shipped config.json files, exact against transformers (meta
    device: nothing is allocated); non-embedding counts as the Qwen3 report lists them."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = json.loads((REPO / "examples" / "qwen3_configs" / size / "config.json").read_text())
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**d))
    arch = Arch.from_hf(d)
    assert arch.hf_params() == sum(p.numel() for p in model.parameters())
    non_embedding = arch.hf_params() - arch.vocab * arch.hidden * (1 if arch.tied else 2)
    published = {"0.6B": 0.44, "1.7B": 1.4, "4B": 3.6, "8B": 6.95, "14B": 13.2, "32B": 31.2}[size]
    assert abs(non_embedding / 1e9 / published - 1) < 0.015  # published to 2-3 digits
    assert arch.tied == (size in ("0.6B", "1.7B", "4B"))


def test_tp_pp_shards_add_up():
    arch = Arch.from_hf(json.loads((REPO / "examples/qwen3_configs/32B/config.json").read_text()))
    from megatron_dppo.jobs.plan import stage_params

    one = stage_params(arch, 1, 1)["only"]
    split = stage_params(arch, 4, 2)
    replicated = arch.layers * (2 * arch.hidden + 2 * arch.head_dim) + arch.hidden  # norms on every TP rank
    vocab_pad = (padded_vocab_size(arch.vocab, 4) - padded_vocab_size(arch.vocab, 1)) * arch.hidden * 2
    assert 4 * (split["first"] + split["last"]) == one + 3 * replicated + vocab_pad


def test_activation_formula():
    arch = Arch(vocab=1000, hidden=1024, layers=4, heads=16, kv_heads=16, head_dim=64, ffn=4096, tied=True)
    none = layer_activation_elems(arch, 1, False, "none")["kept"]
    # MHA with f = 4h: 4h (norm and linear inputs) + 6h (QKV out, q and k, attention out)
    # + 12h (SwiGLU in, fc2 in) = 22h elements. (Korthikanti et al.'s GPT layer, GeLU MLP with
    # dropout masks, keeps 34h bytes: its MLP keeps 8h elements inside where SwiGLU keeps 3f.)
    assert none == 4 * 1024 + 6 * 1024 + 12 * 1024
    assert layer_activation_elems(arch, 4, False, "none")["kept"] == 4 * 1024 + 18 * 1024 / 4
    assert layer_activation_elems(arch, 4, True, "none")["kept"] == none / 4  # SP splits the rest
    assert layer_activation_elems(arch, 4, True, "full")["kept"] == 1024 / 4
    assert layer_activation_elems(arch, 1, False, "selective")["kept"] == none - 12 * 1024


def test_qwen3_32b_config_fits_and_prints_its_plan(capsys):
    plan = memory_plan(_cfg())
    assert plan["fits"], format_plan(plan)
    assert plan["layout"]["gpus"] == 32 and plan["layout"]["dp"] == 4
    assert set(plan["stages"]) == {"first", "last"}
    assert plan["stages"]["first"]["in_flight"] == 2  # 1F1B on 2 stages
    assert plan_main(["--config", str(QWEN3_32B)]) == 0
    out = capsys.readouterr().out
    assert "FITS" in out and "first pipeline stage" in out


def test_too_small_layout_is_refused_naming_a_knob(capsys):
    cfg = _cfg(
        QWEN3_32B,
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.nodes=1",
        "parallel.distributed_optimizer=false",
        "parallel.sequence_parallel=false",
    )
    plan = memory_plan(cfg)
    assert not plan["fits"]
    assert any("training needs" in p for p in plan["problems"])
    assert plan["fixes"] and any(k in plan["fixes"][0] for k in ("parallel.tp", "parallel.distributed_optimizer"))
    assert (
        plan_main(
            [
                "--config",
                str(QWEN3_32B),
                "parallel.tp=1",
                "parallel.pp=1",
                "parallel.nodes=1",
                "parallel.distributed_optimizer=false",
            ]
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "REFUSED" in out and "try" in out


@pytest.mark.parametrize(
    "override, single_fix",
    [
        ("trainer.max_tokens_per_microbatch=65536", "trainer.max_tokens_per_microbatch="),  # activations
        ("rollout.gpu_memory_utilization=0.2", "parallel.rollout_tp=8"),  # KV cache cannot hold a sequence
        ("rollout.gpu_memory_utilization=0.7", "rollout.gpu_memory_utilization="),  # vLLM + Megatron > GPU
    ],
)
def test_refusals_point_at_the_knob_that_fixes_them(override, single_fix):
    plan = memory_plan(_cfg(QWEN3_32B, override))
    assert not plan["fits"]
    assert any(f.startswith(single_fix) for f in plan["fixes"]), plan["fixes"]
    # and the suggested change does fit
    fixed = memory_plan(_cfg(QWEN3_32B, override, plan["fixes"][0].split(" (")[0]))
    assert fixed["fits"]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["parallel.tp=3"], "parallel.tp"),
        (["parallel.tp=16", "parallel.gpus_per_node=16"], "parallel.tp"),  # 16 does not divide 8 KV heads
        (["parallel.pp=3"], "parallel.pp"),
        (["parallel.nodes=1", "parallel.gpus_per_node=6"], "parallel.nodes x parallel.gpus_per_node"),
        (["parallel.rollout_tp=3"], "parallel.rollout_tp"),
        (["parallel.rollout_tp=16"], "parallel.rollout_tp"),  # more than the 8 GPUs of a node
    ],
)
def test_layouts_that_do_not_divide_name_the_field(overrides, field, capsys):
    cfg = _cfg(QWEN3_32B, *overrides)
    with pytest.raises(ValueError) as trainer_says:  # the trainer's own check, same world
        _trainer_check(cfg, load_hf_config(cfg.model.hf_dir), cfg.parallel.nodes * cfg.parallel.gpus_per_node)
    with pytest.raises(ValueError) as err:
        memory_plan(cfg)
    assert str(trainer_says.value) in str(err.value)  # the plan refuses it with the trainer's words
    assert field in str(err.value)
    assert plan_main(["--config", str(QWEN3_32B), *overrides]) == 2
    assert field in capsys.readouterr().out


def test_vllm_tp_beyond_the_kv_heads_is_accepted_by_both():
    """vLLM replicates KV heads when its TP is a multiple of them (Qwen3-32B: 8 KV heads, TP 16 on
    nodes of 16 GPUs): the trainer's check accepts it, so the plan's does too."""
    cfg = _cfg(QWEN3_32B, "parallel.rollout_tp=16", "parallel.gpus_per_node=16", "parallel.nodes=2")
    assert _trainer_accepts(cfg)
    memory_plan(cfg)  # no ValueError


@pytest.mark.parametrize(
    "override, field",
    [
        ("trainer.max_tokens_per_microbatch=1024", "trainer.max_tokens_per_microbatch"),  # < max_model_len 4096
        ("pruning.r_q=1.5", "pruning.r_q"),
    ],
)
def test_plan_refuses_what_the_trainers_config_check_refuses(override, field, capsys):
    with pytest.raises(ValueError, match=field):
        load_config(str(QWEN3_32B), [override])
    assert plan_main(["--config", str(QWEN3_32B), override]) == 2
    assert field in capsys.readouterr().out


def _world(cfg, path) -> list[int]:
    """The world sizes a shipped config runs at: a cluster config on parallel.nodes x
    parallel.gpus_per_node GPUs; the tiny CPU job as 1 process (make main) and under torchrun with 2."""
    if "tiny" in path.relative_to(REPO / "examples").parts:
        return [1, 2]
    return [cfg.parallel.nodes * cfg.parallel.gpus_per_node]


# examples/smollm2's model dir (its config.json: shared_helpers.SMOLLM2_135M_CONFIG_JSON).
SMOLLM2_DIR = ".cache/smollm2/SmolLM2-135M-Instruct"


def _check_shipped(path: Path, worlds: list[int], tmp_path: Path) -> None:
    """The trainer's config checks (load_config) and its start-up layout check, with heads and
    layers from the config's model.hf_dir/config.json; ValueError naming the field otherwise. A
    model the repo builds rather than ships (the tiny MoE: tools/make_tiny_moe.py) is built first."""
    cfg = load_config(str(path))
    if not (REPO / cfg.model.hf_dir / "config.json").exists() and cfg.model.hf_dir == "runs/tiny_moe/model":
        sys.path.insert(0, str(REPO / "tools"))
        import make_tiny_moe

        cfg.model.hf_dir = make_tiny_moe.build(str(tmp_path / "model"))
    if not (REPO / cfg.model.hf_dir / "config.json").exists() and cfg.model.hf_dir == SMOLLM2_DIR:
        # built from PyPI by tools/build_smollm2.py (517 MB): its config.json alone, for the layout check
        (tmp_path / "smollm2").mkdir()
        (tmp_path / "smollm2" / "config.json").write_text(json.dumps(SMOLLM2_135M_CONFIG_JSON))
        cfg.model.hf_dir = str(tmp_path / "smollm2")
    hf = load_hf_config(cfg.model.hf_dir)
    for world in worlds:
        _trainer_check(cfg, hf, world)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO / "examples")))
def test_shipped_configs_pass_the_trainers_checks(path, tmp_path):
    """Every YAML under examples/ passes what the trainer checks at start-up, at the world size
    it is meant for."""
    _check_shipped(path, _world(load_config(str(path), check=False), path), tmp_path)


@pytest.mark.parametrize(
    "line, field",
    [
        ("rollout_tp: 4 ", "parallel.rollout_tp=3"),  # does not divide 64 heads
        ("tp: 4 ", "parallel.tp=3"),
        ("max_tokens_per_microbatch: 8192", "trainer.max_tokens_per_microbatch"),
    ],
)
def test_the_shipped_config_check_can_fail(tmp_path, line, field):
    """The check above on a broken copy of the 32B example."""
    text = QWEN3_32B.read_text()
    assert line in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(line, line.replace("4", "3").replace("8192", "1024"), 1))
    with pytest.raises(ValueError, match=field):
        _check_shipped(bad, [32], tmp_path)


def _trainer_accepts(cfg) -> bool:
    try:
        _trainer_check(cfg, load_hf_config(cfg.model.hf_dir), cfg.parallel.nodes * cfg.parallel.gpus_per_node)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.gpu_memory_utilization=0.2"],  # offers parallel.rollout_tp=8
        ["parallel.nodes=2"],  # offers more nodes, tp, ...
        [
            "parallel.tp=1",
            "parallel.pp=1",
            "parallel.nodes=1",
            "parallel.distributed_optimizer=false",
            "parallel.sequence_parallel=false",
        ],  # a combination
    ],
)
def test_every_layout_the_plan_offers_is_one_the_trainer_accepts(overrides):
    plan = memory_plan(_cfg(QWEN3_32B, *overrides))
    assert not plan["fits"] and plan["fixes"]
    for fix in plan["fixes"]:
        changes = fix.split(" (")[0].split()
        assert _trainer_accepts(_cfg(QWEN3_32B, *overrides, *changes)), fix
    if overrides == ["rollout.gpu_memory_utilization=0.2"]:
        assert any(f.startswith("parallel.rollout_tp=8") for f in plan["fixes"])


@pytest.mark.parametrize("path", PRESETS + [QWEN3_32B], ids=lambda p: p.stem)
def test_layout_choices_are_what_the_trainer_accepts(path):
    """The values a refusal offers for tp, pp and rollout_tp: each accepted by the trainer's check
    (the others at 1), every other value up to the world size refused, and the config's own value
    among them."""
    cfg = load_config(str(path))
    world = cfg.parallel.nodes * cfg.parallel.gpus_per_node
    choices = layout_choices(cfg, Arch.from_hf(load_hf_config(cfg.model.hf_dir)))
    for knob, ok in choices.items():
        assert getattr(cfg.parallel, knob) in ok
        for value in range(1, world + 1):
            par = dataclasses.replace(cfg.parallel, **{"tp": 1, "pp": 1, "rollout_tp": 1, "ep": 1, knob: value})
            assert _trainer_accepts(dataclasses.replace(cfg, parallel=par)) == (value in ok), (knob, value)
    # vLLM on Qwen3 (64 query / 8 KV heads at 32B): the engine's ranks stay inside a node of 8;
    # Qwen2.5-7B's 28 query / 4 KV heads: 8 divides neither (nor is it a multiple of 4 that divides 28)
    assert choices["rollout_tp"] == ([1, 2, 4] if path.stem.startswith("qwen2.5_7b") else [1, 2, 4, 8])


def test_refusal_names_the_values_that_pass(capsys):
    assert plan_main(["--config", str(QWEN3_32B), "parallel.rollout_tp=3", "parallel.pp=3"]) == 2
    out = capsys.readouterr().out
    assert "parallel.rollout_tp among [1, 2, 4, 8]" in out
    assert "parallel.pp among [1, 2, 4, 8, 16, 32]" in out  # 64 layers, 32 GPUs
    assert "parallel.tp among" not in out  # tp=4 is fine


def test_missing_model_config_is_a_named_error():
    with pytest.raises(ValueError, match="model.hf_dir"):
        memory_plan(_cfg(QWEN3_32B, "model.hf_dir=/nonexistent"))


def test_kl_reference_adds_a_weight_copy():
    base, kl = memory_plan(_cfg()), memory_plan(_cfg(QWEN3_32B, "algorithm.kl_coef=0.01"))
    s, k = base["stages"]["last"]["train"], kl["stages"]["last"]["train"]
    assert s["reference"] == 0 and k["reference"] == s["weights"]


def test_presets_cover_every_size_and_fit():
    names = {p.stem for p in PRESETS}
    assert names == {f"qwen3_{s.lower()}" for s in SIZES} | MOE_PRESETS | DISAGG_PRESETS | {
        p.stem for p in TABLE9_PRESETS
    }
    for path in [p for p in PRESETS if p.stem not in MOE_PRESETS] + [QWEN3_32B]:  # the Table 9 ones too
        cfg = load_config(str(path), check=False)
        plan = memory_plan(cfg)
        assert plan["fits"], f"{path.name}:\n{format_plan(plan)}"
        peak = max(max(s["train_total"], s["generate_total"]) for s in plan["stages"].values())
        assert peak < 0.95 * plan["gpu_bytes"]
        assert plan["vllm"]["seqs_fit"] >= 16, path.name  # enough KV for real batching
    # the 32B preset is the example's layout
    assert dataclasses.asdict(
        load_config(str(REPO / "examples/presets/qwen3_32b.yaml"), check=False).parallel
    ) == dataclasses.asdict(load_config(str(QWEN3_32B), check=False).parallel)


# ------------------------------------------------------------------ Table 9: Qwen2.5 and Llama 3.2
@pytest.mark.parametrize(
    "model, total, non_embedding",
    # Qwen2.5's cards: 7.61B / 6.53B, 32.5B / 31.0B (the 32B card rounds down: its 32.76B lands 0.8%
    # off); Llama 3.2's card: 3.21B.
    [("qwen2.5_7b", 7.61, 6.53), ("qwen2.5_32b", 32.5, 31.0), ("llama3.2_3b", 3.21, None)],
)
def test_table9_configs_have_the_published_sizes(model, total, non_embedding):
    """The hand-written config.json files (no hub here): parameter count exact against the family's
    transformers model (meta device), totals as the model cards list them, and what sets each
    family apart as transformers reads the file (ties, biases, RoPE, no sliding window)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_dppo.model.families import rope_parameters

    d = REPO / "examples" / TABLE9[model][0]
    hf = AutoConfig.from_pretrained(d)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(hf)
    arch = Arch.from_hf(json.loads((d / "config.json").read_text()))
    assert arch.hf_params() == sum(p.numel() for p in m.parameters())  # ties counted once
    assert abs(arch.hf_params() / 1e9 / total - 1) < 0.015
    if non_embedding:
        assert abs((arch.hf_params() - 2 * arch.vocab * arch.hidden) / 1e9 / non_embedding - 1) < 0.015
    tied = m.lm_head.weight is m.model.embed_tokens.weight
    assert arch.tied == tied == model.startswith("llama")  # Qwen2.5 7B and up are untied
    assert arch.qkv_bias == (m.model.layers[0].self_attn.q_proj.bias is not None) == model.startswith("qwen")
    assert not arch.qk_norm
    rope = rope_parameters(hf)
    if model.startswith("llama"):
        assert rope == dict(
            rope_type="llama3",
            rope_theta=5e5,
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        )
    else:
        assert rope == {"rope_type": "default", "rope_theta": 1e6}
        assert set(hf.layer_types) == {"full_attention"}  # sliding_window 131072 is listed, not used


@pytest.mark.parametrize("path", TABLE9_PRESETS, ids=lambda p: p.stem)
def test_table9_presets_fit_their_cluster(path, capsys):
    """Each preset: the paper's ratios inside GRPO or DAPO, on MATH (math reward), planned on its
    80 GB cluster (one node of 8 for 7B and 3B, four for 32B): fits below 95% with KV room for
    real batching, and `plan` exits 0."""
    cfg = load_config(str(path))
    model, algo = path.stem.rsplit("_", 1)
    hf_dir, gpus = TABLE9[model]
    assert cfg.model.hf_dir == f"examples/{hf_dir}"
    assert (cfg.parallel.nodes * cfg.parallel.gpus_per_node, cfg.parallel.gpu_memory_gb) == (gpus, 80)
    assert (cfg.pruning.strategy, cfg.pruning.r_q, cfg.pruning.r_o) == ("dppo", 0.5, 0.5)
    assert cfg.reward.kind == "math" and cfg.data.prompt_mode == "chat"
    dapo = algo == "dapo"
    a = cfg.algorithm
    assert (a.clip_low, a.clip_high, a.dynamic_sampling) == (0.2, 0.28 if dapo else 0.2, dapo)
    assert a.loss_agg == ("token-mean" if dapo else "seq-mean-token-mean") and a.kl_coef == 0
    assert (cfg.reward.overlong_buffer > 0) == dapo
    other = load_config(str(path.with_name(f"{model}_{'grpo' if dapo else 'dapo'}.yaml")))
    for section in ("model", "parallel", "data", "rollout", "pruning", "optim"):  # the pair differs in the method only
        assert getattr(cfg, section) == getattr(other, section), section
    plan = memory_plan(cfg)
    assert plan["fits"], format_plan(plan)
    peak = max(max(s["train_total"], s["generate_total"]) for s in plan["stages"].values())
    assert peak < 0.95 * plan["gpu_bytes"]
    assert plan["vllm"]["seqs_fit"] >= 16
    assert plan_main(["--config", str(path)]) == 0
    assert "FITS" in capsys.readouterr().out


@pytest.mark.parametrize("model", TABLE9)
def test_table9_weight_rows_are_the_models_shards(model):
    """The plan's weights and gradients rows against the transformers model's own tensors, cut as
    Megatron cuts them: every tensor split over TP but the RMSNorm weights (replicated; Qwen2.5's
    q/k/v biases are split with their rows), layers split evenly over PP, the embedding on the first
    stage and the final norm and output layer on the last (bf16 weights, fp32 main_grad)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = REPO / "examples" / "presets" / f"{model}_grpo.yaml"
    cfg = load_config(str(path))
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    hf = AutoConfig.from_pretrained(REPO / "examples" / TABLE9[model][0])
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(hf)
    names = ["only"] if pp == 1 else ["first", "last"]
    per_stage = dict.fromkeys(names, 0)
    pad = padded_vocab_size(hf.vocab_size, tp) - hf.vocab_size
    for name, p in m.named_parameters():  # tied: the embedding once, and the last stage's copy below
        n = p.numel() + (pad * hf.hidden_size if "embed_tokens" in name or "lm_head" in name else 0)
        n = n if name.endswith("norm.weight") else n // tp
        if ".layers." in name:
            stage = names[int(name.split(".layers.")[1].split(".")[0]) * pp // hf.num_hidden_layers]
        else:
            stage = names[0] if "embed_tokens" in name else names[-1]
        per_stage[stage] += n
    if hf.tie_word_embeddings and pp > 1:
        per_stage["last"] += (hf.vocab_size + pad) * hf.hidden_size // tp  # the last stage's output copy
    plan = memory_plan(cfg)
    for stage, n in per_stage.items():
        assert plan["stages"][stage]["train"]["weights"] == 2 * n, stage
        assert plan["stages"][stage]["train"]["gradients"] == 4 * n, stage


def test_qwen25_32b_on_one_node_is_refused_naming_more_nodes(capsys):
    """Qwen2.5-32B on one node of 8 x 80 GB: at DP 1 every GPU keeps the whole Adam state of its
    4.1B parameters (12 B each), which with the weights and fp32 gradients leaves no room for
    vLLM or activations; `plan` refuses both phases and names parallel.nodes=4 (the preset)."""
    for algo in ("grpo", "dapo"):
        path = REPO / "examples" / "presets" / f"qwen2.5_32b_{algo}.yaml"
        plan = memory_plan(_cfg(path, "parallel.nodes=1"))
        assert not plan["fits"] and plan["layout"]["dp"] == 1
        assert any("training needs" in p for p in plan["problems"])
        assert any("generation needs" in p for p in plan["problems"])
        first = plan["stages"]["first"]
        assert first["train"]["optimizer"] == 12 * first["params"]  # nothing to shard over
        assert plan["fixes"][0].startswith("parallel.nodes=4 ")
        assert plan_main(["--config", str(path), "parallel.nodes=1"]) == 1
        assert "REFUSED" in capsys.readouterr().out


def test_launch_scripts_parse():
    for script in ("launch_torchrun.sh", "slurm.sbatch"):
        subprocess.run(["bash", "-n", str(REPO / "examples" / "qwen3_32b" / script)], check=True)


# ------------------------------------------------------------------ mixture of experts (Qwen3 MoE)
A3B = REPO / "examples" / "presets" / "qwen3_30b_a3b.yaml"
A22B = REPO / "examples" / "presets" / "qwen3_235b_a22b.yaml"


@pytest.mark.parametrize("size, total, active", [("30B-A3B", 30.5, 3.3), ("235B-A22B", 235, 22)])
def test_qwen3_moe_configs_have_the_published_sizes(size, total, active):
    """The MoE config.json files: parameter count exact against transformers' Qwen3MoeForCausalLM
    (meta device), total and activated counts as Qwen3's model cards list them."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    d = json.loads((REPO / "examples" / "qwen3_configs" / size / "config.json").read_text())
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{k: v for k, v in d.items() if k != "transformers_version"}))
    arch = Arch.from_hf(d)
    assert arch.hf_params() == sum(p.numel() for p in model.parameters())
    assert arch.experts == 128 and arch.experts_per_tok == 8 and all(arch.sparse) and len(arch.sparse) == arch.layers
    assert abs(arch.hf_params() / 1e9 / total - 1) < 0.015 and abs(arch.active_params() / 1e9 / active - 1) < 0.03


def test_expert_state_is_per_ep_rank_and_sharded_over_expert_dp():
    """Per GPU: this EP rank's experts (128 / ep of each layer); their optimizer state divided by
    the expert-DP size (GPUs / (ep x pp)), the dense part's by DP."""
    cfg = load_config(str(A3B), check=False)
    arch = Arch.from_hf(load_hf_config(cfg.model.hf_dir))
    plan = memory_plan(cfg)
    lay, first = plan["layout"], plan["stages"]["first"]
    assert (lay["dp"], lay["ep"], lay["edp"]) == (8, 8, 1)
    per_expert = 3 * 2048 * 768
    assert first["expert_params"] == 24 * 16 * per_expert  # 24 layers on the stage, 16 experts each
    dense = first["params"] - first["expert_params"]
    assert first["train"]["optimizer"] == 12 * (dense / 8 + first["expert_params"] / 1)
    assert first["train"]["gradients"] == 4 * first["params"]
    assert "all_to_all" in first["train"] and first["train"]["all_to_all"] > 0
    assert first["train"]["routing_replay"] == 0  # rollout.routing_replay off
    replay = memory_plan(_cfg(A3B, "rollout.routing_replay=true"))["stages"]["first"]["train"]["routing_replay"]
    T = cfg.trainer.max_tokens_per_microbatch // (cfg.parallel.tp if lay["sequence_parallel"] else 1)
    assert replay == 24 * T * 8 * 8  # 24 sparse layers on the stage, top-8, int64
    # at EP 16 on the same 16 GPUs (PP 1) each GPU holds 8 experts of all 48 layers
    wide = memory_plan(_cfg(A3B, "parallel.pp=1", "parallel.ep=16"))["stages"]["only"]
    assert wide["expert_params"] == 48 * 8 * per_expert
    assert wide["params"] - wide["expert_params"] == arch.hf_params() - 48 * 128 * per_expert  # dense whole at TP 1


def test_moe_presets_fit_and_one_node_is_refused(capsys):
    """Qwen3-30B-A3B fits two nodes of 8 x 80 GB; on one node it is refused by memory (its fp32
    gradients and Adam state alone exceed the GPU), naming both phases. 235B-A22B fits its 128
    nodes; at 64 nodes and vLLM's 75% it is refused at generation, since the weight-sync row is the
    sync's peak (one MoE layer of 128 experts, 4.6 GiB, in flight, not a 1 GiB bucket)."""
    plan = memory_plan(load_config(str(A3B)))
    assert plan["fits"], format_plan(plan)
    big = memory_plan(load_config(str(A22B)))
    assert big["fits"], format_plan(big)
    assert big["stages"]["last"]["generate"]["weight_sync"] > 4 * 2**30  # the whole layer's experts
    half = memory_plan(_cfg(A22B, "parallel.nodes=64", "rollout.gpu_memory_utilization=0.75"))
    assert not half["fits"] and all("generation needs" in p for p in half["problems"]), format_plan(half)
    assert plan_main(["--config", str(A3B)]) == 0
    assert "experts: EP 8 x ETP 1 x expert DP 1" in capsys.readouterr().out
    one = memory_plan(_cfg(A3B, "parallel.nodes=1", "parallel.pp=1"))
    assert not one["fits"]
    assert any("training needs" in p for p in one["problems"]) and any("generation needs" in p for p in one["problems"])
    resident = sum(one["stages"]["only"]["train"][k] for k in ("weights", "gradients", "optimizer"))
    assert resident > 0.85 * one["gpu_bytes"]  # 71.5 of 80 GiB before any activation or vLLM
    assert plan_main(["--config", str(A3B), "parallel.nodes=1", "parallel.pp=1"]) == 1
    assert "REFUSED" in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.ep=3"], "parallel.ep=3 must divide num_experts 128"),
        (["parallel.ep=32"], "parallel.ep=32 x parallel.etp=1 x parallel.pp=2 must divide the world size 16"),
        (["parallel.etp=5"], "parallel.etp=5 must divide moe_intermediate_size 768"),
        (["parallel.tp=2"], "parallel.tp=2 with a mixture-of-experts model needs parallel.sequence_parallel=true"),
    ],
)
def test_expert_layouts_that_do_not_divide_name_the_field(overrides, message, capsys):
    cfg = _cfg(A3B, *overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        _trainer_check(cfg, load_hf_config(cfg.model.hf_dir), 16)
    assert plan_main(["--config", str(A3B), *overrides]) == 2
    assert message in capsys.readouterr().out


def test_ep_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="parallel.ep=2 needs a mixture-of-experts model"):
        memory_plan(_cfg(QWEN3_32B, "parallel.ep=2"))


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
            "architectures=['MistralForCausalLM']: only ('Qwen3ForCausalLM', 'Qwen3MoeForCausalLM', "
            "'LlamaForCausalLM', 'Qwen2ForCausalLM') are supported",
        ),
        (
            {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True},
            "use_sliding_window=true (Qwen2ForCausalLM)",
        ),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": True}, "attention_bias=true"),
        ({"use_sliding_window": True}, "use_sliding_window=true"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
            "rope_type='yarn'",
        ),
    ],
)
def test_plan_refuses_every_model_the_trainer_refuses(tmp_path, edit, message, capsys):
    """Issue 24: `plan` said FITS for a Llama model that `train` refuses. Both now run the same
    check (model/qwen3.layout_from_hf_config): the trainer's (qwen3.read_model_config, what
    hf_dir.check_hf_model_dir calls) and the plan's refusals carry the same words."""
    from megatron_dppo.model import qwen3

    d = dict(json.loads((REPO / "examples/qwen3_configs/8B/config.json").read_text()), **edit)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=re.escape(message)) as trainer_says:
        qwen3.read_model_config(str(tmp_path / "config.json"))
    with pytest.raises(ValueError) as plan_says:
        memory_plan(_cfg(REPO / "examples/presets/qwen3_8b.yaml", f"model.hf_dir={tmp_path}"))
    assert str(trainer_says.value).split(": ", 1)[1] in str(plan_says.value) and "model.hf_dir" in str(plan_says.value)
    assert plan_main(["--config", str(REPO / "examples/presets/qwen3_8b.yaml"), f"model.hf_dir={tmp_path}"]) == 2
    assert message in capsys.readouterr().out


def test_weight_sync_row_is_the_sync_peak():
    """The generate phase's sync row is sync_peak_bytes: at least the largest unit the export
    gathers whole (a layer with all its experts, or the padded embedding) plus vLLM's reload of one
    layer; the bucket size counts only when it is the larger."""
    for path in (A3B, A22B, QWEN3_32B):
        cfg = load_config(str(path), check=False)
        plan = memory_plan(cfg)
        arch, par = Arch.from_hf(load_hf_config(cfg.model.hf_dir)), cfg.parallel
        pbytes = 2  # bfloat16, the presets' dtype
        peak = sync_peak_bytes(arch, pbytes, tp=par.tp, ep=par.ep, etp=par.etp, rollout_tp=par.rollout_tp)
        for stage in plan["stages"].values():
            assert stage["generate"]["weight_sync"] == peak["total"]
        layer = max(
            arch.layer_params(1, arch.is_sparse(i)) + arch.expert_params() * arch.is_sparse(i)
            for i in range(arch.layers)
        )
        embedding = padded_vocab_size(arch.vocab, par.tp) * arch.hidden
        assert peak["trainer"] >= max(layer, embedding) * pbytes
        assert peak["vllm"] == 2 * layer * pbytes / par.rollout_tp
    moe = Arch.from_hf(load_hf_config("examples/qwen3_configs/235B-A22B"))
    small = sync_peak_bytes(moe, 2, tp=4, ep=128, etp=1, rollout_tp=8, bucket=1)
    large = sync_peak_bytes(moe, 2, tp=4, ep=128, etp=1, rollout_tp=8, bucket=64 << 30)
    assert large["trainer"] - small["trainer"] == (64 << 30) - (moe.layer_params(1, True) + moe.expert_params()) * 2


# ---- LoRA (model.lora; jobs/plan_lora.py) ------------------------------------------------------

# model.lora.targets role -> the HF modules PEFT adapts for it (one A, B pair each)
LORA_HF_MODULES = {"qkv": ["q_proj", "k_proj", "v_proj"], "proj": ["o_proj"], "fc1": ["gate_proj", "up_proj"]}
LORA_HF_MODULES["fc2"] = ["down_proj"]


def _peft_trainable(model, targets: list[str], rank: int, experts: bool) -> int:
    """Trainable parameters after peft.get_peft_model with the HF modules of `targets`: the
    independent count. An expert's modules (mlp.experts.<e>.*) are targeted only with `experts`."""
    from peft import LoraConfig, get_peft_model

    names = "|".join(n for t in targets for n in LORA_HF_MODULES[t])
    pattern = rf".*\.(self_attn|mlp)\.({names})"
    if experts:
        pattern += rf"|.*\.mlp\.experts\.\d+\.({names})"
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, target_modules=pattern))
    return sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


def _tiny_moe_model(tmp_path):
    """A tiny Qwen3-MoE (layer 1 dense, layers 0 and 2 sparse) as HF checkpoints lay it out:
    each expert its own gate_proj, up_proj, down_proj (transformers 5 fuses them in memory, so
    the per-expert modules are put back for PEFT to adapt one by one). Returned inside a plain
    ModuleDict, without the `config` by which PEFT would rewrite the targets for transformers 5's
    fused experts (one gate_up_proj pair). Returns (model, its config dir)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    for i in (0, 2):
        model.model.layers[i].mlp.experts = torch.nn.ModuleList(
            Qwen3MoeMLP(config, intermediate_size=config.moe_intermediate_size) for _ in range(config.num_experts)
        )
    d = tmp_path / "moe"
    d.mkdir(parents=True)
    (d / "config.json").write_text(config.to_json_string())
    return torch.nn.ModuleDict({"hf": model}), d


def _world1_cfg(hf_dir, *overrides):
    return _cfg(
        None,
        f"model.hf_dir={hf_dir}",
        "parallel.nodes=1",
        "parallel.gpus_per_node=1",
        "rollout.max_model_len=64",
        "trainer.max_tokens_per_microbatch=1024",
        *overrides,
    )


@pytest.mark.parametrize("targets", [["qkv", "proj", "fc1", "fc2"], ["qkv"], ["proj", "fc2"]])
def test_lora_adapter_count_equals_peft_on_a_dense_model(tmp_path, targets):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg, d = _tiny_cfg(tmp_path)
    cfg = _with_lora(cfg, rank=8, targets=targets)
    torch.manual_seed(0)
    expected = _peft_trainable(Qwen3ForCausalLM(Qwen3Config(**d)), targets, 8, experts=False)
    plan = memory_plan(cfg)
    assert plan["lora"]["adapter_params"] == expected
    assert plan["stages"]["only"]["adapter_params"] == expected  # one GPU holds them all
    assert plan["sync_bytes"] == expected * 4  # float32: the sync sends the adapters only


@pytest.mark.parametrize("experts", [False, True])
def test_lora_adapter_count_equals_peft_on_a_moe_model(tmp_path, experts):
    model, hf_dir = _tiny_moe_model(tmp_path)
    targets = ["qkv", "proj", "fc1", "fc2"]
    expected = _peft_trainable(model, targets, 4, experts=experts)
    plan = memory_plan(_world1_cfg(hf_dir, "model.lora.rank=4", f"model.lora.experts={str(experts).lower()}"))
    assert plan["lora"]["adapter_params"] == expected
    stage = plan["stages"]["only"]
    assert stage["adapter_params"] == expected
    # experts=false still adapts the dense layer's MLP; true adds 4 experts x 3 modules x 2 sparse layers
    per_expert = 4 * (32 + 16) * 3
    assert (expected - _peft_trainable(_tiny_moe_model(tmp_path / "again")[0], targets, 4, False)) == (
        2 * 4 * per_expert if experts else 0
    )


def _with_lora(cfg, **lora):
    out = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model))
    out.model.lora = dataclasses.replace(cfg.model.lora, **lora)
    return out


def test_lora_memory_is_full_minus_the_frozen_weights_state(tmp_path):
    """bf16, one GPU: LoRA keeps the base weights (2 B each) and drops their fp32 gradient (4 B)
    and Adam state (12 B: m, v, fp32 master); the adapters take 2 + 4 + 12 B each. The resident
    gap is exactly that; a plan that still counted the base weights' optimizer state fails it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg, d = _tiny_cfg(tmp_path, dtype="bfloat16")
    torch.manual_seed(0)
    adapters = _peft_trainable(Qwen3ForCausalLM(Qwen3Config(**d)), ["qkv", "proj", "fc1", "fc2"], 8, False)
    full, lora = memory_plan(cfg), memory_plan(_with_lora(cfg, rank=8))
    n = full["stages"]["only"]["params"]

    def resident(p):
        s = p["stages"]["only"]["train"]
        return {k: s[k] for k in ("weights", "gradients", "optimizer")}

    f, lo = resident(full), resident(lora)
    assert lo == {"weights": (n + adapters) * 2, "gradients": adapters * 4, "optimizer": adapters * 12}
    assert sum(f.values()) - sum(lo.values()) == n * (4 + 12) - adapters * (2 + 4 + 12)
    for phase in ("train_total", "generate_total"):
        assert lora["stages"]["only"][phase] < full["stages"]["only"][phase]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_activations_add_each_pairs_rank_and_each_linears_dropout(tmp_path, dropout):
    """recompute none, one GPU: each of the 7 pairs keeps its r-wide A output for every token; with
    dropout each adapted linear (qkv, proj, fc1, fc2: its pairs share one) keeps its dropped input
    (h, nq d, h, f) and the 1-byte mask. The KL reference is the base with the adapters off: no copy."""
    cfg, d = _tiny_cfg(tmp_path)  # float32, 3 layers, h 128, 4 heads x 32, f 512
    cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, kl_coef=0.1))
    full, lora = memory_plan(cfg), memory_plan(_with_lora(cfg, rank=8, dropout=dropout))
    tokens, layers, h, q, f = 1024, 3, 128, 4 * 32, 512
    per_token_layer = 7 * 8 + (dropout > 0) * (h + q + h + f) * (1 + 1 / 4)
    full_s, lora_s = full["stages"]["only"]["train"], lora["stages"]["only"]["train"]
    assert lora_s["activations"] - full_s["activations"] == pytest.approx(tokens * layers * per_token_layer * 4)
    assert full_s["reference"] == full_s["weights"] and lora_s["reference"] == 0


# LoRA runs without sequence parallelism (config/checks.py: the adapters see each linear's whole
# input), which the 32B preset turns on
NO_SP = "parallel.sequence_parallel=false"


def test_lora_state_is_sharded_like_the_layout_on_the_32b_preset():
    """TP 4 x PP 2 x DP 4: a rank's adapters are its TP shard (column: B split, A whole; row: A
    split, B whole), their Adam state is split over DP; the base keeps only its bf16 weights."""
    from megatron_dppo.jobs.plan_lora import adapter_params, hf_adapter_params, layer_adapters

    cfg = _cfg(QWEN3_32B, "model.lora.rank=64", NO_SP)
    arch = Arch.from_hf(load_hf_config(cfg.model.hf_dir))
    full, lora = memory_plan(_cfg(QWEN3_32B)), memory_plan(cfg)
    adapters = layer_adapters(arch, cfg.model.lora, False)
    whole = sum(a.params(64) for a in adapters)
    replicated = sum(a.replicated(64) for a in adapters)
    assert hf_adapter_params(arch, cfg.model.lora) == arch.layers * whole
    # h = 5120, q = 8192, kv = 1024, f = 25600: 7 pairs, 8,388,608 params a layer, 0.54B in all
    assert whole == 64 * (3 * 5120 + 8192 + 2 * 1024 + 8192 + 5120 + 2 * (5120 + 25600) + 25600 + 5120)
    per_rank = adapter_params(arch, cfg.model.lora, range(32), tp=4)["dense"]
    assert 4 * per_rank == 32 * (whole + 3 * replicated)  # the 4 TP shards add up to the replicated halves 4 times
    for name, s in lora["stages"].items():
        a, n = s["adapter_params"], s["params"]
        assert a == per_rank and n == full["stages"][name]["params"]
        assert s["train"]["gradients"] == 4 * a and s["train"]["optimizer"] == 12 * a / 4
        assert s["train"]["weights"] == 2 * (n + a)
        assert s["train_total"] < full["stages"][name]["train_total"]
    assert lora["sync_bytes"] == 2 * 64 * whole and full["sync_bytes"] == 2 * arch.hf_params()


def test_lora_plan_names_the_rank_and_the_sync_bytes(capsys):
    assert plan_main(["--config", str(QWEN3_32B), "model.lora.rank=32", NO_SP]) == 0
    out = capsys.readouterr().out
    assert "lora r=32 (alpha 32, targets qkv,proj,fc1,fc2, experts off)" in out
    assert "weight sync per step: 0.50 GiB (the adapters only, 122x less than every weight)" in out
    assert plan_main(["--config", str(QWEN3_32B)]) == 0
    out = capsys.readouterr().out
    assert "full fine-tuning" in out and "weight sync per step: 61.02 GiB (every weight)" in out


def test_lora_step_time_moves_only_the_adapters():
    """plan_step's W (the sync's bytes) is the adapters' with LoRA."""
    from megatron_dppo.jobs.plan import plan_step_time

    flags = dict(gen_tokens_per_s=1000.0, train_tokens_per_s=1000.0, transfer_gb_per_s=10.0)
    flags.update(dedicated_gen_tokens_per_s=None, dedicated_train_tokens_per_s=None, sync_gb_per_s=None)
    flags.update(generated_tokens=None, trained_tokens=None)
    args = type("Args", (), flags)
    for overrides in ([], ["model.lora.rank=64", NO_SP]):
        cfg = _cfg(QWEN3_32B, *overrides)
        plan = memory_plan(cfg)
        st = plan_step_time(cfg, plan, args)
        assert st["weight_bytes"] == plan["sync_bytes"]
        assert st["rows"]["colocated"]["weights_s"] == plan["sync_bytes"] / 10e9


def test_smallest_layout_of_the_32b_with_lora_is_smaller_than_full_fine_tuning(capsys):
    """The search (jobs/plan_smallest.py) finds fewer GPUs for LoRA r=64 than for full fine-tuning
    (whose base weights' gradients and Adam state, 16 B a parameter over DP, need many GPUs), and
    the layout it names is one the trainer's checks accept and that fits when planned again."""
    from megatron_dppo.jobs.plan_smallest import smallest_layout

    full = smallest_layout(_cfg(QWEN3_32B))
    lora = smallest_layout(_cfg(QWEN3_32B, "model.lora.rank=64", NO_SP))
    assert lora["gpus"] < full["gpus"], (lora["overrides"], full["overrides"])
    for found, extra in ((full, []), (lora, ["model.lora.rank=64", NO_SP])):
        again = memory_plan(load_config(str(QWEN3_32B), [*extra, *found["overrides"].split()]))
        assert again["fits"] and again["layout"]["gpus"] == found["gpus"]
    assert plan_main(["--config", str(QWEN3_32B), "--smallest", "model.lora.rank=64", NO_SP]) == 0
    assert f"smallest layout that fits: {lora['gpus']} GPUs" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--smallest", "--max-gpus", "0"], "plan: --max-gpus: expected an integer >= 1, got 0"),
        (["--smallest", "--max-gpus", "8"], "smallest layout: none fits on up to 8 GPUs (--max-gpus)"),
    ],
)
def test_smallest_layout_bad_or_empty_search_is_one_line(argv, message, capsys):
    code = plan_main(["--config", str(QWEN3_32B), *argv])
    out = capsys.readouterr().out.strip()
    assert out == message and code == (2 if "expected" in message else 1)


def test_smallest_layout_refuses_dedicated_rollout_ranks(capsys):
    path = REPO / "examples/presets/qwen3_32b_disagg.yaml"
    assert plan_main(["--config", str(path), "--smallest"]) == 2
    assert "plan: --smallest: searches colocated layouts; parallel.rollout_ranks=" in capsys.readouterr().out


def test_lora_weight_sync_row_is_the_adapters_export():
    """megatron/lora.py's export: one tensor merged over TP at a time (2 x the largest: down_proj's
    A, gate/up's B, 64 x 25600), and at PP > 1 the pickled all-gather of every stage's share
    through the GPU (output: all of them; input: this stage's half); vLLM loads one tensor at a time."""
    largest = 2 * 64 * 25600 * 2  # gather buffer + merged copy, bf16
    for overrides, gathered in ((["parallel.pp=2"], 1.5), (["parallel.pp=1", "parallel.tp=8"], 0)):
        plan = memory_plan(_cfg(QWEN3_32B, "model.lora.rank=64", NO_SP, *overrides))
        sync = plan["sync_bytes"]
        for stage in plan["stages"].values():
            assert stage["generate"]["weight_sync"] == gathered * sync + largest + largest
