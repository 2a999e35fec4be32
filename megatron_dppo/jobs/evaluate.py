"""`megatron-dppo evaluate`: score a model on the validation sets without training.

    megatron-dppo evaluate --config run.yaml [--checkpoint DIR] [--out-dir DIR] [overrides]

The same sets, renderer (prompt mode, chat_template_kwargs), reward scorer, sampling (eval.*,
rollout.max_new_tokens, rollout.stop) and metrics as the trainer's validation
(evaluation.run_validation), in one process. The model: model.hf_dir, read by vLLM directly; or,
with --checkpoint, a Megatron checkpoint (a trainer step_* dir, a trainer checkpoint root with
`latest`, or a converted checkpoint), converted to a temporary HF dir inside the output dir
(megatron_to_hf_checkpoint, in a child process: Megatron's parallel state and CPU shim stay out
of vLLM's process) and removed after. The tokenizer is model.hf_dir's either way.

Output dir (default <trainer.output_dir>/<trainer.run_name>-evaluate, apart from the training
run dir, so evaluating first never blocks a fresh `train`): step_<N>.jsonl (every answer, as the
trainer's <run_dir>/val/ dumps) and step_<N>.metrics.json, N the checkpoint's step (0 for the HF
model). The table of metrics goes to stdout.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys

from megatron_dppo.rollout.validation import engine_generate, load_eval_sets, run_validation


def _checkpoint_step(checkpoint: str, cfg) -> tuple[str, int]:
    """(the checkpoint dir, its step), checked like the trainer checks one before loading it: its
    files, and its model against model.hf_dir (run_identity.check_checkpoint_model)."""
    from megatron_dppo.megatron.checkpoint import check_checkpoint
    from megatron_dppo.megatron.convert_ckpt import resolve_checkpoint_dir
    from megatron_dppo.run.identity import check_checkpoint_model

    if not os.path.exists(checkpoint):
        raise FileNotFoundError(
            f"--checkpoint {checkpoint} does not exist (expected a run's checkpoints/ dir, one of its step_* "
            "dirs, or a converted checkpoint)"
        )
    path = resolve_checkpoint_dir(checkpoint)
    state = check_checkpoint(path)
    check_checkpoint_model(state, cfg, path)
    return path, int(state.get("step", 0))


def prepare_out_dir(out_dir: str | None, cfg) -> str:
    """The output dir, created now: one that cannot be (a file, a path under /proc) is a
    ValueError naming the option or key it came from, before anything slow."""
    tc = cfg.trainer
    source = "--out-dir" if out_dir else "trainer.output_dir (evaluate writes to <output_dir>/<run_name>-evaluate)"
    out_dir = out_dir or os.path.join(tc.output_dir, f"{tc.run_name}-evaluate")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{source}: {out_dir} exists and is not a directory")
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write-test-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        why = f"{e.strerror or e}: {e.filename or out_dir}"
        raise ValueError(f"{source}: {out_dir} cannot be written ({why})") from None
    return out_dir


def _convert(checkpoint: str, out_dir: str, tokenizer_dir: str) -> None:
    from megatron_dppo.megatron.convert_ckpt import megatron_to_hf_checkpoint

    megatron_to_hf_checkpoint(checkpoint, out_dir, tokenizer_dir=tokenizer_dir, log=lambda *_: None)


def convert_in_child(checkpoint: str, out_dir: str, tokenizer_dir: str) -> None:
    """megatron_to_hf_checkpoint in a spawned process; its exception is re-raised here."""
    with mp.get_context("spawn").Pool(1) as pool:
        pool.apply(_convert, (checkpoint, out_dir, tokenizer_dir))


def format_table(metrics: dict) -> str:
    """val/<set>/<source>/<metric> -> one row per (set, source), one column per metric."""
    rows: dict[tuple[str, str], dict] = {}
    columns: list[str] = []
    for key, value in metrics.items():
        if not key.startswith("val/"):
            continue
        set_name, rest = key[4:].split("/", 1)
        source, metric = rest.rsplit("/", 1)
        rows.setdefault((set_name, source), {})[metric] = value
        if metric not in columns:
            columns.append(metric)
    head = ["set", "data_source"] + columns
    body = [[s, src] + [f"{v.get(c, float('nan')):.4f}" for c in columns] for (s, src), v in rows.items()]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(r, widths)) for r in [head] + body]
    return "\n".join(lines)


def run_evaluate(cfg, checkpoint: str | None = None, out_dir: str | None = None, out=print) -> dict:
    """Score the model (module docstring); -> the metrics."""
    from megatron_dppo.data.prompts import PromptRenderer
    from megatron_dppo.model.hf_dir import check_model
    from megatron_dppo.rewards import RewardScorer
    from megatron_dppo.rollout import RolloutEngine

    rc, tc = cfg.rollout, cfg.trainer
    out_dir = prepare_out_dir(out_dir, cfg)
    _, tokenizer = check_model(cfg.model.hf_dir)  # train's checks of the model dir
    ckpt, step = _checkpoint_step(checkpoint, cfg) if checkpoint else (None, 0)
    renderer = PromptRenderer(
        tokenizer, cfg.data.prompt_mode, cfg.data.system_prompt or None, cfg.data.chat_template_kwargs
    )
    warnings: list[str] = []
    sets = load_eval_sets(
        cfg,
        renderer,
        max_prompt_tokens=rc.max_model_len - rc.max_new_tokens,
        skip=cfg.data.skip_long_prompts,
        limit_desc=f"rollout.max_model_len {rc.max_model_len} - rollout.max_new_tokens {rc.max_new_tokens}",
        warnings=warnings,
    )
    for line in warnings:
        out(line)
    if not sets:
        raise ValueError("evaluate: no validation sets: set eval.sets (name -> path) or data.eval")
    model_dir, temp_dir = cfg.model.hf_dir, None
    if checkpoint:
        temp_dir = os.path.join(out_dir, f"hf-step_{step:06d}-{os.getpid()}")
        out(f"converting {ckpt} (step {step}) to {temp_dir}")
        convert_in_child(ckpt, temp_dir, cfg.model.hf_dir)
        model_dir = temp_dir
    scorer = engine = None
    try:
        scorer = RewardScorer.from_config(cfg.reward)
        engine = RolloutEngine(
            model_dir,
            dtype=rc.dtype or cfg.model.dtype,
            max_model_len=rc.max_model_len,
            seed=tc.seed,
            kv_cache_memory_bytes=None if _cuda() else int(rc.kv_cache_gb * (1 << 30)),
            gpu_memory_utilization=rc.gpu_memory_utilization,
        )
        metrics = run_validation(
            sets,
            generate=engine_generate(engine, rc.max_new_tokens, rc.stop),
            scorer=scorer,
            renderer=renderer,
            cfg=cfg.eval,
            step=step,
            dump_dir=out_dir,
            seed=tc.seed,
        )
    finally:
        if engine is not None:
            engine.close()
        if scorer is not None:
            scorer.close()
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)  # ours, inside the output dir
    with open(os.path.join(out_dir, f"step_{step:06d}.metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    sizes = ", ".join(f"{s.name} {len(s.records)}" for s in sets)
    out(
        f"{'checkpoint ' + checkpoint if checkpoint else model_dir}: prompts {sizes}; n={cfg.eval.n}, "
        f"temperature {cfg.eval.temperature}; answers in {os.path.join(out_dir, f'step_{step:06d}.jsonl')}"
    )
    out(format_table(metrics))
    sys.stdout.flush()
    return metrics


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
