"""`megatron-dppo plan`: will this run fit, per GPU, before we ask a cluster for it?

The plan is arithmetic over the run config and the model's config.json (no Megatron, no vLLM,
no GPU: it runs anywhere in about a second). docs/scaling.md derives every term;
in short, for the worst pipeline stage of one GPU:

  weights      params (model.dtype) of this TP/PP shard, Megatron's padded vocabulary included
  gradients    fp32 main_grad buffer (Megatron DDP, grad_reduce_in_fp32) = 4 B/param
  optimizer    Adam m, v (+ fp32 master copy for bf16 params) = 12 B/param (8 for fp32),
               divided by DP under the distributed optimizer
  reference    a second copy of the weights when algorithm.kl_coef > 0
  activations  per layer per token for a GQA SwiGLU layer (layer_activation_elems) x layers
               on the stage x micro-batch tokens x micro-batches in flight (pp on the first
               1F1B stage). parallel.recompute: selective = Megatron recompute_modules
               ["core_attn", "mlp"]; full = granularity full, method uniform, 1 layer per chunk
  logits       micro-batch tokens x padded vocab / TP x (dtype + 8) bytes on the last stage
  vLLM         colocated: asleep (KV freed, weights offloaded) while Megatron trains; while it
               generates it owns gpu_memory_utilization x GPU: its weights, runtime and the KV
               cache that is left
  overhead     CUDA context, NCCL and cuBLAS workspaces (fixed) + allocator fragmentation

Two phases are checked: train (Megatron peak, vLLM asleep) and generate (Megatron's resident
state + vLLM awake). A layout that does not fit is refused with the knobs that would fix it.
The config is checked first by the trainer's own rules (config.load_config's validation and
config.check_layout with world = nodes x gpus_per_node), so `plan` accepts what `train` accepts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

GiB = 1 << 30
REPO = Path(__file__).resolve().parents[1]

# Estimates, not measurements (docs/scaling.md says where they come from).
CUDA_OVERHEAD = 2 * GiB  # CUDA context (~0.5 GiB), NCCL buffers, cuBLAS/TE workspaces
FRAGMENTATION = 0.10  # caching-allocator slack on the training peak (variable-size packs)
VLLM_RUNTIME = 2 * GiB  # vLLM's profiled activation peak + CUDA graphs, inside its share
SYNC_BUCKET = 1 * GiB  # one bucket of the Megatron -> vLLM weight sync in flight
VOCAB_DIVISIBLE_BY = 128  # Megatron's make_vocab_size_divisible_by (model.py uses 128)


@dataclass(frozen=True)
class Arch:
    """The numbers of a Qwen3-style dense model (GQA attention, SwiGLU MLP, RMSNorm, qk-norm)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool

    @classmethod
    def from_hf(cls, c: dict) -> Arch:
        if c.get("num_experts") or c.get("num_local_experts"):
            raise ValueError("the memory plan covers dense models; this config.json is a mixture of experts")
        return cls(
            vocab=c["vocab_size"],
            hidden=c["hidden_size"],
            layers=c["num_hidden_layers"],
            heads=c["num_attention_heads"],
            kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            ffn=c["intermediate_size"],
            tied=bool(c.get("tie_word_embeddings", False)),
        )

    def layer_params(self, tp: int = 1) -> int:
        """One decoder layer on one TP rank: QKV, out-proj, fc1 [gate; up], fc2 are split over TP;
        the two RMSNorms (hidden) and q/k-norms (head_dim) are replicated."""
        h, d = self.hidden, self.head_dim
        split = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * h * self.ffn
        return split // tp + 2 * h + 2 * d

    def hf_params(self) -> int:
        """Parameter count of the HF checkpoint (unpadded vocabulary)."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden


def padded_vocab(vocab: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Megatron pads the vocabulary so each TP rank gets an equal multiple of `divisible_by`
    (same formula as megatron_dppo.megatron.model.padded_vocab_size, kept import-free here)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def stage_params(arch: Arch, tp: int, pp: int) -> dict:
    """Parameters held by one GPU of the first and of the last pipeline stage."""
    emb = padded_vocab(arch.vocab, tp) * arch.hidden // tp
    body = arch.layers // pp * arch.layer_params(tp)
    if pp == 1:
        only = body + emb + arch.hidden + (0 if arch.tied else emb)
        return {"only": only}
    # A tied model's last stage keeps its own copy of the embedding as the output layer.
    return {"first": body + emb, "last": body + arch.hidden + emb}


def layer_activation_elems(arch: Arch, tp: int, sp: bool, recompute: str) -> dict:
    """Elements one layer keeps for backward per token on one TP rank (fused GPU path: flash
    attention keeps no s x s scores, SwiGLU fused). Returns {'kept': per layer, 'work': the
    extra a recomputed layer rebuilds during its own backward (held for one layer only)}.

      replicated over TP (divided by TP only with sequence parallel):
        4h      inputs of the two RMSNorms and of the two column-parallel linears (QKV, fc1)
      split over TP:
        (nq + 2 nkv) d   QKV output (q/k-norm inputs are views of it, so all of it stays)
        (nq + nkv) d     q and k after qk-norm + RoPE, as flash attention saves them
        nq d             attention output = out-proj input
        2f + f           SwiGLU input [gate; up] and fc2 input
    """
    h, d, f, nq, nkv = arch.hidden, arch.head_dim, arch.ffn, arch.heads, arch.kv_heads
    rep = 4 * h / (tp if sp else 1)
    attn = (3 * nq + 3 * nkv) * d / tp
    mlp = 3 * f / tp
    full = rep + attn + mlp
    if recompute == "none":
        return {"kept": full, "work": 0.0}
    if recompute == "selective":  # Megatron recompute_modules=["core_attn", "mlp"]: MLP rebuilt
        return {"kept": rep + attn, "work": mlp}
    # full: each layer keeps only its input hidden states (sequence-sharded with SP)
    return {"kept": h / (tp if sp else 1), "work": full}


def _dtype_bytes(name: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[name]


def load_hf_config(hf_dir: str) -> dict:
    """config.json of model.hf_dir (relative paths: the working directory, then the repo)."""
    for base in (Path.cwd(), REPO):
        path = base / hf_dir / "config.json"
        if path.is_file():
            return json.loads(path.read_text())
    raise ValueError(f"config key 'model.hf_dir': {hf_dir!r} has no config.json (the plan needs only that file)")


def layout_choices(cfg, arch: Arch) -> dict[str, list[int]]:
    """The values of parallel.tp, parallel.pp and parallel.rollout_tp that the trainer's layout
    check (config.check_layout) accepts on this cluster and model, each with the other two at 1.
    What the plan offers is filtered through the same check, so it cannot offer a value the
    trainer refuses."""
    from megatron_dppo.config import check_layout as trainer_check

    world = cfg.parallel.nodes * cfg.parallel.gpus_per_node
    out = {}
    for knob in ("tp", "pp", "rollout_tp"):
        ok = []
        for value in range(1, world + 1):
            par = dataclasses.replace(cfg.parallel, **{"tp": 1, "pp": 1, "rollout_tp": 1, knob: value})
            try:
                trainer_check(
                    dataclasses.replace(cfg, parallel=par),
                    world_size=world,
                    num_heads=arch.heads,
                    num_kv_heads=arch.kv_heads,
                    num_layers=arch.layers,
                )
            except ValueError:
                continue
            ok.append(value)
        out[knob] = ok
    return out


def check_layout(cfg, arch: Arch) -> None:
    """The trainer's layout rules (config.check_layout, the world being parallel.nodes x
    parallel.gpus_per_node) with the values that would pass; ValueError naming the fields."""
    from megatron_dppo.config import check_layout as trainer_check

    par = cfg.parallel
    world = par.nodes * par.gpus_per_node
    try:
        trainer_check(cfg, world_size=world, num_heads=arch.heads, num_kv_heads=arch.kv_heads, num_layers=arch.layers)
    except ValueError as e:
        choices = layout_choices(cfg, arch)
        hints = "; ".join(f"parallel.{k} among {v}" for k, v in choices.items() if getattr(par, k) not in v)
        raise ValueError(
            f"the trainer refuses this layout on parallel.nodes x parallel.gpus_per_node = "
            f"{par.nodes} x {par.gpus_per_node} = {world} GPUs: {e}" + (f" (choose {hints})" if hints else "")
        ) from None


def memory_plan(cfg, fixes: bool = True) -> dict:
    """Bytes per GPU for both phases of a step, the verdict and (fixes=True) the knobs that
    would fix a refused layout. Raises ValueError naming the field when the layout does not
    divide."""
    par, roll, tr = cfg.parallel, cfg.rollout, cfg.trainer
    arch = Arch.from_hf(load_hf_config(cfg.model.hf_dir))
    check_layout(cfg, arch)
    world = par.nodes * par.gpus_per_node
    tp, pp = par.tp, par.pp
    dp = world // (tp * pp)
    gpu = par.gpu_memory_gb * GiB
    pbytes = _dtype_bytes(cfg.model.dtype)
    dist_opt = True if par.distributed_optimizer is None else par.distributed_optimizer  # on with CUDA
    # Adam m and v in fp32, plus the fp32 master copy when the params themselves are not fp32.
    opt_per_param = 8 + (4 if pbytes < 4 else 0)
    T = tr.max_tokens_per_microbatch
    act = layer_activation_elems(arch, tp, par.sequence_parallel and tp > 1, par.recompute)
    layers_here = arch.layers // pp
    vocab_p = padded_vocab(arch.vocab, tp)

    stages = {}
    for stage, n in stage_params(arch, tp, pp).items():
        in_flight = pp if stage == "first" else 1  # 1F1B: stage 0 holds pp forwards before its first backward
        has_logits = stage in ("only", "last")
        resident = {
            "weights": n * pbytes,
            "gradients": n * 4,
            "optimizer": n * opt_per_param / (dp if dist_opt else 1),
            "reference": n * pbytes if cfg.algorithm.kl_coef > 0 else 0,
        }
        train = dict(resident)
        train["activations"] = (in_flight * layers_here * act["kept"] + act["work"]) * T * pbytes
        # the model's logits + the fp32 scaled/masked copy the loss keeps (its softmax) + one
        # fp32 temporary while the next copy or the gradient is made
        train["logits"] = T * vocab_p / tp * (pbytes + 8) if has_logits else 0
        allocated = sum(train.values())
        train["overhead"] = CUDA_OVERHEAD + FRAGMENTATION * allocated
        gen = dict(resident)
        gen["vllm"] = roll.gpu_memory_utilization * gpu
        gen["weight_sync"] = SYNC_BUCKET
        gen["overhead"] = CUDA_OVERHEAD
        stages[stage] = {
            "params": n,
            "in_flight": in_flight,
            "train": train,
            "generate": gen,
            "train_total": sum(train.values()),
            "generate_total": sum(gen.values()),
        }

    worst = max(stages, key=lambda s: max(stages[s]["train_total"], stages[s]["generate_total"]))

    # vLLM: one engine per rollout_tp GPUs; KV heads are split over its ranks (replicated when
    # rollout_tp > kv heads).
    rbytes = _dtype_bytes(roll.dtype or cfg.model.dtype)
    engines = world // par.rollout_tp
    vllm_weights = arch.hf_params() * rbytes / par.rollout_tp
    kv_per_token = 2 * arch.layers * max(1, arch.kv_heads // par.rollout_tp) * arch.head_dim * rbytes
    kv_cache = roll.gpu_memory_utilization * gpu - vllm_weights - VLLM_RUNTIME
    seq_bytes = roll.max_model_len * kv_per_token
    seqs_fit = max(0, int(kv_cache // seq_bytes))
    seqs_needed = math.ceil(tr.prompts_per_step * roll.group_size / engines)

    plan = {
        "model": dict(
            dataclasses.asdict(arch),
            params=arch.hf_params(),
            padded_vocab=vocab_p,
            model_type=load_hf_config(cfg.model.hf_dir).get("model_type", "?"),
        ),
        "layout": dict(
            gpus=world,
            nodes=par.nodes,
            gpus_per_node=par.gpus_per_node,
            tp=tp,
            pp=pp,
            dp=dp,
            sequence_parallel=par.sequence_parallel and tp > 1,
            distributed_optimizer=dist_opt,
            recompute=par.recompute,
            rollout_tp=par.rollout_tp,
            engines=engines,
            dtype=cfg.model.dtype,
            micro_batch_tokens=T,
            reference=cfg.algorithm.kl_coef > 0,
        ),
        "gpu_bytes": gpu,
        "activation_bytes_per_token_layer": act["kept"] * pbytes,
        "stages": stages,
        "worst_stage": worst,
        "vllm": dict(
            weights=vllm_weights,
            runtime=VLLM_RUNTIME,
            kv_cache=kv_cache,
            kv_per_token=kv_per_token,
            max_model_len=roll.max_model_len,
            seqs_fit=seqs_fit,
            seqs_needed=seqs_needed,
            host_ram_per_node=vllm_weights * par.gpus_per_node,
            sleep_level=roll.sleep_level,
        ),
    }
    plan["problems"], plan["notes"] = _verdict(plan, cfg)
    plan["fits"] = not plan["problems"]
    plan["fixes"] = suggest_fixes(cfg, plan) if fixes and not plan["fits"] else []
    return plan


def _verdict(plan, cfg) -> tuple[list[str], list[str]]:
    gpu, v = plan["gpu_bytes"], plan["vllm"]
    problems, notes = [], []
    for phase in ("train", "generate"):
        name, s = max(plan["stages"].items(), key=lambda kv: kv[1][phase + "_total"])
        where = "" if name == "only" else f" on the {name} pipeline stage"
        if s[phase + "_total"] > gpu:
            why = (
                "Megatron's peak, vLLM asleep"
                if phase == "train"
                else f"Megatron's resident state + vLLM's {cfg.rollout.gpu_memory_utilization:.0%}"
            )
            problems.append(
                f"{'training' if phase == 'train' else 'generation'} needs "
                f"{s[phase + '_total'] / GiB:.1f} GiB per GPU{where} ({why}) > {gpu / GiB:.0f} GiB"
            )
    if v["seqs_fit"] < 1:
        problems.append(
            f"vLLM's KV cache ({max(v['kv_cache'], 0) / GiB:.1f} GiB after its weights and runtime) "
            f"cannot hold one sequence of rollout.max_model_len={v['max_model_len']} "
            f"({v['max_model_len'] * v['kv_per_token'] / GiB:.2f} GiB)"
        )
    elif v["seqs_fit"] < v["seqs_needed"]:
        notes.append(
            f"vLLM holds {v['seqs_fit']} full-length sequences at once, the step asks "
            f"{v['seqs_needed']} per engine: generation runs in waves (raise "
            f"rollout.gpu_memory_utilization or parallel.rollout_tp for fewer)"
        )
    return problems, notes


def _candidates(cfg, plan) -> list[str]:
    """Single-knob changes worth trying, in the order we would recommend them."""
    par, lay = cfg.parallel, plan["layout"]
    out = []
    if not lay["distributed_optimizer"] and lay["dp"] > 1:
        out.append("parallel.distributed_optimizer=true")
    out += [
        f"parallel.recompute={r}"
        for r in ("selective", "full")
        if ("none", "selective", "full").index(r) > ("none", "selective", "full").index(par.recompute)
    ]
    if par.tp > 1 and not par.sequence_parallel:
        out.append("parallel.sequence_parallel=true")
    t = cfg.trainer.max_tokens_per_microbatch
    while t // 2 >= cfg.rollout.max_model_len:  # a full-length sequence must still fit
        t //= 2
        out.append(f"trainer.max_tokens_per_microbatch={t}")
    for u in (0.6, 0.5, 0.4, 0.3, 0.2):
        if u < cfg.rollout.gpu_memory_utilization:
            out.append(f"rollout.gpu_memory_utilization={u}")
    out += [f"parallel.rollout_tp={r}" for r in (2, 4, 8) if r > par.rollout_tp]
    out += [f"parallel.tp={t}" for t in (2, 4, 8) if t > par.tp]
    out += [f"parallel.pp={p}" for p in (2, 4, 8) if p > par.pp]
    # More GPUs shrink only what the distributed optimizer shards: offer the two together.
    dist = "" if lay["distributed_optimizer"] else " parallel.distributed_optimizer=true"
    out += [f"parallel.nodes={n}{dist}" for n in (2 * par.nodes, 4 * par.nodes)]
    return out


def _with(cfg, overrides: str):
    """A copy of cfg with space-separated section.key=value overrides applied."""
    for override in overrides.split():
        key, value = override.split("=")
        section, name = key.split(".")
        value = {"true": True, "false": False}.get(value, value)
        old = getattr(getattr(cfg, section), name)
        value = type(old)(value) if old is not None and not isinstance(value, bool) else value
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **{name: value})})
    return cfg


def _peak(p) -> float:
    return max(max(s["train_total"], s["generate_total"]) for s in p["stages"].values())


def _badness(p) -> tuple:
    """How far a plan is from fitting (0 when it fits); then its peak, to break ties."""
    over = max(0.0, _peak(p) - p["gpu_bytes"]) + (p["gpu_bytes"] if p["vllm"]["seqs_fit"] < 1 else 0)
    return over, _peak(p)


def suggest_fixes(cfg, plan, max_changes: int = 6) -> list[str]:
    """Single-knob changes that make the layout fit. When no single knob
    does, a greedy combination: repeatedly apply the change that brings it closest to fitting."""

    def tried(c, p):
        out = []
        for change in _candidates(c, p):
            try:
                out.append((_badness(q := memory_plan(_with(c, change), fixes=False)), change, q))
            except ValueError:
                continue  # does not divide: not a fix
        return sorted(out, key=lambda t: t[0])

    # Fitting single changes in the order _candidates recommends them (cheap knobs before
    # more hardware), not by peak: all of them fit.
    order = {c: i for i, c in enumerate(_candidates(cfg, plan))}
    singles = sorted(((order[ch], ch, bad) for bad, ch, q in tried(cfg, plan) if q["fits"]))
    if singles:
        return [f"{ch} (peak {bad[1] / GiB:.1f} GiB)" for _, ch, bad in singles[:6]]
    chosen, cur, cur_plan = {}, cfg, plan
    for _ in range(max_changes):
        options = tried(cur, cur_plan)
        if not options or options[0][0] >= _badness(cur_plan):
            break
        bad, change, cur_plan = options[0]
        for part in change.split():  # a later value of the same knob replaces the earlier
            chosen[part.split("=")[0]] = part
        cur = _with(cur, change)
        if cur_plan["fits"]:
            return [" ".join(chosen.values()) + f" (together; peak {bad[1] / GiB:.1f} GiB)"]
    if not chosen:
        return []
    return [" ".join(chosen.values()) + f" (together they help, still {_badness(cur_plan)[0] / GiB:.1f} GiB over)"]


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _gib(x: float) -> str:
    return f"{x / GiB:7.2f}"


def format_plan(plan: dict) -> str:
    m, lay, v = plan["model"], plan["layout"], plan["vllm"]
    lines = [
        f"model: {m['model_type']} {_count(m['params'])} params (hidden {m['hidden']}, {m['layers']} layers, "
        f"{m['heads']}/{m['kv_heads']} heads x {m['head_dim']}, ffn {m['ffn']}, vocab {m['vocab']} -> "
        f"{m['padded_vocab']} padded, {'tied' if m['tied'] else 'untied'} embeddings)",
        f"layout: {lay['gpus']} GPUs = {lay['nodes']} x {lay['gpus_per_node']}; TP {lay['tp']} x PP {lay['pp']} x "
        f"DP {lay['dp']}; {lay['dtype']}; sequence parallel {'on' if lay['sequence_parallel'] else 'off'}; "
        f"distributed optimizer {'on' if lay['distributed_optimizer'] else 'off'}; recompute {lay['recompute']}; "
        f"micro-batch {lay['micro_batch_tokens']} tokens; vLLM TP {lay['rollout_tp']} ({lay['engines']} engines)",
        f"activations: {plan['activation_bytes_per_token_layer'] / 1024:.1f} KiB per token per layer kept",
    ]
    rows = [
        ("weights", "weights"),
        ("gradients (fp32 main_grad)", "gradients"),
        ("optimizer (Adam m,v [+fp32 master])", "optimizer"),
        ("reference model", "reference"),
        ("activations", "activations"),
        ("logits (fp32 loss)", "logits"),
        ("vLLM (weights+runtime+KV)", "vllm"),
        ("weight-sync bucket", "weight_sync"),
        ("CUDA ctx/NCCL/fragmentation", "overhead"),
    ]
    for name, s in plan["stages"].items():
        lines.append(
            "per GPU:"
            if name == "only"
            else f"per GPU, {name} pipeline stage ({s['in_flight']} micro-batch(es) in flight):"
        )
        lines.append(f"  {'GiB':<38}{'train':>8}{'generate':>10}")

        def cell(x):
            return "-".rjust(7) if x is None else _gib(x)

        for label, key in rows:
            tr, ge = s["train"].get(key), s["generate"].get(key)
            if (tr or 0) or (ge or 0):
                lines.append(f"  {label:<38} {cell(tr)}   {cell(ge)}")
        lines.append(
            f"  {'total of ' + format(plan['gpu_bytes'] / GiB, '.0f') + ' GiB':<38} "
            f"{_gib(s['train_total'])}   {_gib(s['generate_total'])}"
        )
    lines.append(
        f"vLLM per GPU: weights {v['weights'] / GiB:.2f} GiB, runtime {v['runtime'] / GiB:.1f} GiB, "
        f"KV cache {v['kv_cache'] / GiB:.2f} GiB at {v['kv_per_token'] / 1024:.0f} KiB/token = "
        f"{v['seqs_fit']} sequences of {v['max_model_len']} tokens (step: {v['seqs_needed']} per engine); "
        + (
            f"sleep level 1 parks its weights in host RAM: {v['host_ram_per_node'] / GiB:.0f} GiB per node"
            if v["sleep_level"] == 1
            else f"sleep level 2 drops its weights (level 1 would park {v['host_ram_per_node'] / GiB:.0f} GiB "
            f"per node in host RAM)"
        )
    )
    lines += [f"note: {n}" for n in plan["notes"]]
    if plan["fits"]:
        lines.append(
            f"FITS: peak {max(max(s['train_total'], s['generate_total']) for s in plan['stages'].values()) / GiB:.1f} "
            f"GiB of {plan['gpu_bytes'] / GiB:.0f} GiB per GPU"
        )
    else:
        lines += [f"REFUSED: {p}" for p in plan["problems"]]
        if plan["fixes"]:
            lines += ["try one of:"] + [f"  {f}" for f in plan["fixes"]]
        else:
            lines.append("no single knob helps: more GPUs (parallel.nodes) or a smaller model")
    return "\n".join(lines)


def plan_main(argv=None) -> int:
    """`megatron-dppo plan --config FILE [section.key=value ...]`: 0 fits, 1 does not fit,
    2 bad config or a layout that does not divide."""
    from megatron_dppo.config import load_config

    parser = argparse.ArgumentParser(prog="megatron-dppo plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="run config YAML")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=8")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)  # the trainer's config checks, then its layout check
        plan = memory_plan(cfg)
    except (ValueError, OSError) as e:
        print(f"plan: {e}")
        return 2
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    return 0 if plan["fits"] else 1


if __name__ == "__main__":
    import sys

    sys.exit(plan_main())
