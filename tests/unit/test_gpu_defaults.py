"""GPU-only settings that must resolve to today's behaviour on this CPU, checked against the
libraries' own names so a rename upstream fails here rather than on a lent GPU."""

import dataclasses
from pathlib import Path

import pytest

from megatron_dppo.rollout import vllm_engine

QWEN3_32B = Path(__file__).resolve().parents[2] / "examples" / "qwen3_32b" / "config.yaml"


def test_sleeping_gpu_engines_release_cuda_graphs_and_nccl_buffers():
    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(vllm_engine.GPU_SLEEP_RELEASE) <= fields, set(vllm_engine.GPU_SLEEP_RELEASE) - fields
    assert vllm_engine.sleep_release_kwargs(True, True, {"block_size": 16}) == {
        "sleep_mode_offload_cudagraph": True,
        "enable_nccl_comm_suspend": True,
        "block_size": 16,
    }
    # the caller's own choice wins; a CPU engine or one that never sleeps gets nothing added
    assert (
        vllm_engine.sleep_release_kwargs(True, True, {"enable_nccl_comm_suspend": False})["enable_nccl_comm_suspend"]
        is False
    )
    assert vllm_engine.sleep_release_kwargs(False, True, {}) == {}
    assert vllm_engine.sleep_release_kwargs(True, False, {}) == {}


def _resolved(overrides=(), **facts):
    from tiny_config import FACTS, TINY

    from megatron_dppo.config import load_config, resolve

    return resolve(load_config(TINY, list(overrides)), **{**FACTS, **facts}).parallel


def test_cpu_resolves_the_gpu_settings_to_the_behaviour_before_them():
    from megatron_dppo.megatron.model import GpuSettings
    from megatron_dppo.megatron.policy import _config_overrides

    par = _resolved()
    assert (par.overlap_grad_reduce, par.ddp_bucket_size, par.overlap_param_gather) == (False, 0, False)
    assert not (par.gradient_accumulation_fusion or par.moe_permute_fusion or par.moe_router_fusion)
    assert par.recompute_modules is None  # recompute none: unused, left out of the saved config
    assert GpuSettings.from_config(par) == GpuSettings()
    # the TransformerConfig overrides the CPU policy builds, as they were before the keys existed
    assert _config_overrides("local", 1, 1, False, "selective", GpuSettings.from_config(par)) == dict(
        calculate_per_token_loss=True, recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]
    )
    assert _resolved(["parallel.recompute=selective"]).recompute_modules == ["core_attn", "mlp"]


def test_gpu_resolution_follows_megatron_lm_recipes():
    from tiny_config import TINY_MOE_ARCH

    from megatron_dppo.megatron.model import GpuSettings
    from megatron_dppo.megatron.policy import _config_overrides

    gpu = dict(cuda=True, te=True, wgrad_kernel=True)  # a GPU with TE and APEX's fused wgrad kernel
    moe = _resolved(**gpu, model=TINY_MOE_ARCH, world_size=16, local_world_size=8)
    assert moe.overlap_grad_reduce and moe.ddp_bucket_size == 40_000_000  # max(40M, 1M x DP=16)
    assert moe.gradient_accumulation_fusion and moe.moe_permute_fusion and moe.moe_router_fusion
    # without APEX's kernel Megatron's output layer refuses gradient_accumulation_fusion: off, or named
    assert not _resolved(cuda=True, te=True, wgrad_kernel=False).gradient_accumulation_fusion
    with pytest.raises(ValueError, match=r"'parallel\.gradient_accumulation_fusion'.*fused_weight_gradient_mlp_cuda"):
        _resolved(["parallel.gradient_accumulation_fusion=true"], cuda=True, te=True, wgrad_kernel=False)
    wide = _resolved(**gpu, world_size=64, local_world_size=8)
    assert wide.ddp_bucket_size == 64_000_000 and not wide.moe_permute_fusion  # dense: no MoE fusions
    local = _resolved(cuda=True, te=False)  # a GPU without TE: overlap yes, TE fusions no
    assert local.overlap_grad_reduce and not local.gradient_accumulation_fusion
    assert _resolved(["parallel.overlap_grad_reduce=false"], cuda=True).ddp_bucket_size == 0
    sel = ["parallel.recompute=selective"]
    assert _resolved(sel, cuda=True, te=True).recompute_modules == ["core_attn"]  # flash attention: free
    moe_sel = _resolved(sel, cuda=True, te=True, model=TINY_MOE_ARCH)
    assert moe_sel.recompute_modules == ["core_attn", "layernorm"]  # + the unfused pre-MLP norm
    assert _resolved(sel, cuda=True, te=False).recompute_modules == ["core_attn", "mlp"]  # local path
    over = _config_overrides("te", 1, 1, False, "none", GpuSettings.from_config(moe))
    assert over["gradient_accumulation_fusion"] and over["moe_permute_fusion"] and over["moe_router_fusion"]


@pytest.mark.parametrize(
    "override, facts, match",
    [
        ("parallel.overlap_param_gather=true", {"cuda": True, "te": True}, r"'parallel\.overlap_param_gather'"),
        ("parallel.gradient_accumulation_fusion=true", {}, r"'parallel\.gradient_accumulation_fusion'.*Transformer"),
        ("parallel.moe_router_fusion=true", {"cuda": True}, r"'parallel\.moe_router_fusion'"),
        ("parallel.ddp_bucket_size=-1", {}, r"'parallel\.ddp_bucket_size'"),
        ("parallel.recompute_modules=[mlp,attention]", {}, r"'parallel\.recompute_modules'"),
    ],
)
def test_a_gpu_setting_that_cannot_run_is_refused_naming_its_key(override, facts, match):
    with pytest.raises(ValueError, match=match):
        _resolved([override], **facts)


def test_plan_shows_the_gpu_settings_and_follows_the_recompute_modules():
    from megatron_dppo.jobs.plan import format_plan, layer_activation_elems, memory_plan, moe_layer_activation_elems
    from megatron_dppo.model.arch import Arch

    arch = Arch(vocab=1000, hidden=1024, layers=4, heads=16, kv_heads=16, head_dim=64, ffn=4096, tied=True)
    none = layer_activation_elems(arch, 1, False, "none")["kept"]
    assert layer_activation_elems(arch, 1, False, "selective")["kept"] == none - 12 * 1024  # the MLP's 3f
    assert layer_activation_elems(arch, 1, False, "selective", ("core_attn",))["kept"] == none
    moe = dataclasses.replace(arch, experts=8, experts_per_tok=2, moe_ffn=512, sparse=(True,) * 4)
    act = moe_layer_activation_elems(moe, 1, False, "selective", 1, 2)["kept"]
    assert moe_layer_activation_elems(moe, 1, False, "selective", 1, 2, ("layernorm",))["kept"] == act - 1024
    assert moe_layer_activation_elems(moe, 1, False, "selective", 1, 2, ("moe",))["kept"] < act

    from megatron_dppo.config import load_config

    default = memory_plan(load_config(str(QWEN3_32B), [], check=False))
    lean = memory_plan(load_config(str(QWEN3_32B), ["parallel.recompute_modules=[core_attn,mlp]"], check=False))
    assert default["layout"]["gpu_settings"]["overlap_grad_reduce"] is True  # planned as a GPU run with TE
    assert default["layout"]["gpu_settings"]["recompute_modules"] == ["core_attn"]  # TE: Megatron's default
    first = lean["stages"]["first"]["train"]["activations"]
    assert default["stages"]["first"]["train"]["activations"] > 2 * first
    assert "GPU settings: overlap_grad_reduce on (buckets of 40M params)" in format_plan(default)
