"""The run's checkpoints and HF exports: when a step saves, what a save holds besides the policy
(where the prompts are, the pruning strategy's and the curriculum's state, the prompt history, the
next step's rollout in flight), what --resume restores, and the policy as an HF model directory.
The format itself (sharded, checked, pruned to trainer.keep_checkpoints) is megatron/checkpoint.py's.

Every method is collective (every training rank calls it); rank 0 writes what only one rank writes."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import time
from dataclasses import dataclass

from megatron_dppo.algorithms.history import PromptHistory
from megatron_dppo.config import Config
from megatron_dppo.run import collectives as mdist
from megatron_dppo.run.cadence import save_cost_line, should_save
from megatron_dppo.train.startup import RunPaths
from megatron_dppo.train.step_rollout import PendingRound


@dataclass
class Restored:
    """What --resume takes from a checkpoint besides what it loads in place (policy, data order,
    strategy, curriculum): its step, its prompt history, and the later steps' rollouts it saved."""

    step: int
    history: PromptHistory
    pending: list[PendingRound]


class Checkpoints:
    def __init__(self, cfg: Config, paths: RunPaths, *, policy, data, strategy, curriculum, is_main: bool, watchdog):
        """paths: the run dir, its checkpoints dir, and the identity a resume must match
        (run/identity.py). data, strategy, curriculum (None without AdaPrefix): the trainer's,
        saved from and restored into in place."""
        self.cfg, self.run_dir, self.ckpt_dir, self.resume_meta = cfg, paths.run_dir, paths.ckpt_dir, paths.resume_meta
        self.policy, self.data, self.strategy, self.curriculum = policy, data, strategy, curriculum
        self.is_main, self.watchdog = is_main, watchdog
        self.run_id = None  # the run_id the checkpoints carry: the resumed one's, else new at the first save
        self.cost_logged = False
        self.last_save = time.monotonic()

    # ---- when --------------------------------------------------------------------------------------
    def start_clock(self) -> None:
        """trainer.save_every_minutes counts from the first step, not from the start-up."""
        self.last_save = time.monotonic()

    def save_due(self, step: int, final: bool) -> bool:
        """Rank 0's clock decides (the ranks' clocks differ); save_every and final agree anyway."""
        return mdist.agree(should_save(step, time.monotonic(), self.last_save, self.cfg.trainer, final))

    def export_due(self, step: int, final: bool) -> bool:
        every = self.cfg.trainer.save_hf_every
        return bool(every and (step % every == 0 or final))

    # ---- save and restore --------------------------------------------------------------------------
    def save(self, step: int, row: dict, history: PromptHistory, pending: list[PendingRound], logger) -> dict:
        """-> the save's cost, as metrics. The step's metrics `row` (without the save's cost, not
        known yet) is staged in the run dir first (RunLogger.stage): the loop logs it only after the
        save, and a run killed in between resumes after this step with the staged row restored, so no
        step that a checkpoint claims lacks its row. pending: the next steps' first rounds, already
        rolled out (trainer.max_staleness = k >= 1), saved beside the checkpoint."""
        from megatron_dppo.megatron.checkpoint import PENDING_ROLLOUT, checkpoint_bytes, new_run_id, save_checkpoint

        self.watchdog.phase("save", step)
        logger.stage(row)
        self.run_id = self.run_id or new_run_id()
        t0 = time.perf_counter()
        extra_files = {"hf_config.json": os.path.join(self.cfg.model.hf_dir, "config.json")}
        pending_file = os.path.join(self.run_dir, "." + PENDING_ROLLOUT)
        if pending and self.is_main:
            with open(pending_file, "w") as f:
                json.dump({"rounds": [p.to_state() for p in pending]}, f)
            extra_files[PENDING_ROLLOUT] = pending_file
        path = save_checkpoint(
            self.ckpt_dir,
            step,
            self.policy,
            {
                "data": self.data.state_dict(),
                "strategy": self.strategy.state_dict(),
                "adaprefix": self.curriculum.state_dict() if self.curriculum else None,
                "resume": self.resume_meta,
                # LoRA: what the adapters-only checkpoint needs to become a PEFT dir or merged weights
                # (tools/convert_megatron_to_hf.py); the base is resume.model (path and fingerprint)
                "lora": dataclasses.asdict(self.cfg.model.lora) if self.cfg.model.lora.rank else None,
            },
            history,
            keep_last=self.cfg.trainer.keep_checkpoints,
            extra_files=extra_files,
            run_id=self.run_id,
        )
        if PENDING_ROLLOUT in extra_files:
            os.remove(pending_file)
        seconds = time.perf_counter() - t0
        size = checkpoint_bytes(path) if self.is_main else 0
        if self.is_main and not self.cost_logged:  # once: what a save costs
            logger.message(save_cost_line(os.path.basename(path), seconds, size))
            self.cost_logged = True
        self.last_save = time.monotonic()
        return {"time/checkpoint": seconds, "checkpoint/bytes": size}

    def restore(self, path: str, rolls_ahead: int) -> Restored:
        """Load the checkpoint at `path` (startup.check_resumable checked it) into the policy, the
        data order, the strategy and the curriculum. rolls_ahead: the steps this run rolls out ahead
        (dedicated rollout ranks: trainer.max_staleness), so it can take that many saved rounds."""
        from megatron_dppo.megatron.checkpoint import load_checkpoint, read_pending_rollout

        state = load_checkpoint(path, self.policy)
        self.data.load_state_dict(state["data"])
        self.strategy.load_state_dict(state.get("strategy", {}))
        if self.curriculum and state.get("adaprefix") is not None:
            self.curriculum.load_state_dict(state["adaprefix"])
        history = PromptHistory.load(state["history_path"])
        self.run_id = state["run_id"]
        saved = read_pending_rollout(path)  # saved at trainer.max_staleness >= 1: the next steps' rollouts
        rounds = [] if saved is None else saved.get("rounds", [saved])  # one round, unlisted: before k > 1
        if len(rounds) > rolls_ahead:
            steps = f"step {state['step'] + 1}'s rollout" if len(rounds) == 1 else f"{len(rounds)} steps' rollouts"
            raise ValueError(
                f"--resume: {path} holds {steps}, sampled ahead (parallel.rollout_ranks > 0, "
                f"trainer.max_staleness={len(rounds)}): resume with trainer.max_staleness >= {len(rounds)} "
                "and dedicated rollout ranks"
            )
        by_id = {r.id: r for r in self.data.records}
        return Restored(state["step"], history, [PendingRound.from_state(r, by_id) for r in rounds])

    # ---- HF exports --------------------------------------------------------------------------------
    def export_hf(self, step: int) -> str:
        """<run dir>/hf/step_N/: the policy as an HF model directory (gathered from every TP/PP rank),
        loadable by transformers and vLLM with no other tool. A step repeated after a resume replaces
        its earlier export (as save_checkpoint replaces a re-saved step); a failure is an OSError
        naming trainer.save_hf_every and the path (the step's row is already written)."""
        from megatron_dppo.megatron.checkpoint import step_dir_name
        from megatron_dppo.megatron.weights import save_hf_checkpoint

        out = os.path.join(self.run_dir, "hf", step_dir_name(step))
        error = None
        try:  # rank 0 writes; every rank agrees on its outcome, so none is left in a collective
            if self.is_main and os.path.lexists(out):
                if not os.path.isdir(out) or os.path.islink(out):
                    raise FileExistsError(errno.EEXIST, "exists and is not a directory", out)
                shutil.rmtree(out)
        except OSError as e:
            error = e
        if mdist.agree(error is None):
            try:
                if getattr(self.policy, "adapters", None) is not None:  # LoRA: a PEFT adapter dir on model.hf_dir
                    self._export_adapters(out)
                else:
                    save_hf_checkpoint(self.policy.hf_weight_buckets(), out, self.cfg.model.hf_dir, self.is_main)
            except OSError as e:
                error = e
        if not mdist.agree(error is None):
            why = "on rank 0"
            if error is not None:
                why = f"{error.strerror or error}{': ' + str(error.filename) if error.filename else ''}"
            raise OSError(
                f"config key 'trainer.save_hf_every': exporting step {step} as an HF model to {out} failed "
                f"({why}); step {step}'s metrics are written and --resume continues after the latest checkpoint"
            )
        return out

    def _export_adapters(self, out: str) -> None:
        """LoRA's HF export: the adapters as a PEFT adapter directory (PeftModel.from_pretrained on
        model.hf_dir loads it; tools/convert_megatron_to_hf.py --merge-lora makes merged weights)."""
        from megatron_dppo.model.peft_dir import hf_modules, write_peft_adapter

        tensors = self.policy.hf_adapters()  # collective
        if self.is_main:
            lora = self.cfg.model.lora
            write_peft_adapter(
                out,
                tensors,
                rank=lora.rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                target_modules=hf_modules(lora.targets),
                base_model=os.path.realpath(self.cfg.model.hf_dir),
            )
