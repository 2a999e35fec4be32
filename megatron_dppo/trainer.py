"""The DPPO training loop. One step, top to bottom, is `Trainer.step`:

    prompts -> prune prompts (history) -> rollout (vLLM) -> rewards -> group advantages
    -> prune completions -> history update -> pack (THD) -> old/ref log-probs
    -> optimizer step(s) -> weight sync to vLLM -> log

Everything distributed is decided identically on every rank: the prompt batch (same sampler
seed), the pruning masks (a generator seeded by (seed, step)), the packs. Each rank generates
for its slice of the prompts, the groups are gathered, and then each data-parallel rank trains
on its own share of the packs. Megatron details live in megatron_dppo/megatron/.
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_dppo import packing
from megatron_dppo.algorithms import losses
from megatron_dppo.algorithms.advantages import group_advantages
from megatron_dppo.algorithms.history import PromptHistory
from megatron_dppo.algorithms.pruning import drop_zero_variance_groups, get_strategy
from megatron_dppo.config import Config, save_config
from megatron_dppo.data import PromptDataset, PromptRenderer, load_records
from megatron_dppo.rewards import RewardScorer
from megatron_dppo.run_log import RunLogger


@dataclass
class Rollout:
    """Every group of one step, gathered on every rank. Row q is a rolled-out prompt."""
    records: list            # PromptRecord per group
    batch_pos: list          # its position in the step's prompt batch (mini-batch assignment)
    prompt_ids: list         # token ids per group
    completions: list        # [q][i] token ids
    rewards: torch.Tensor    # [P, G]
    prompt_weight: torch.Tensor  # [P] w_q from prompt pruning
    info: dict = field(default_factory=dict)


class PhaseTimer:
    def __init__(self):
        self.times = {}

    @contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


def _world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gather_lists(local: list) -> list:
    """Concatenate every rank's list, in rank order (small python objects: token ids, floats)."""
    rank, world = _world()
    if world == 1:
        return local
    parts = [None] * world
    dist.all_gather_object(parts, local)
    return [x for part in parts for x in part]


def _my_slice(n: int) -> range:
    rank, world = _world()
    per = math.ceil(n / world)
    return range(min(rank * per, n), min((rank + 1) * per, n))


def _step_generator(seed: int, step: int) -> torch.Generator:
    """The same generator on every rank: pruning masks must agree across ranks."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False):
        from transformers import AutoConfig, AutoTokenizer

        from megatron_dppo.megatron import initialize_parallel, suspend_cpu_compat, validate_layout
        from megatron_dppo.megatron.step import LossConfig, MegatronPolicy
        from megatron_dppo.rollout import RolloutEngine

        self.cfg = cfg
        tc, pc, rc, ac = cfg.trainer, cfg.parallel, cfg.rollout, cfg.algorithm
        if tc.threads:
            torch.set_num_threads(tc.threads)
        self.hf_config = AutoConfig.from_pretrained(cfg.model.hf_dir)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        validate_layout(world, pc.tp, pc.pp, self.hf_config.num_attention_heads,
                        self.hf_config.num_key_value_heads, self.hf_config.num_hidden_layers)
        if tc.max_tokens_per_microbatch < rc.max_model_len:
            raise ValueError(
                f"trainer.max_tokens_per_microbatch ({tc.max_tokens_per_microbatch}) is below "
                f"rollout.max_model_len ({rc.max_model_len}), the longest sequence a rollout can produce: "
                "raise the micro-batch budget or lower rollout.max_model_len")
        initialize_parallel(pc.tp, pc.pp, seed=tc.seed)
        from megatron.core import parallel_state
        self.ps = parallel_state
        self.rank, self.world = _world()
        self.is_main = self.rank == 0
        self.run_dir = os.path.join(tc.output_dir, tc.run_name)
        self.ckpt_dir = os.path.join(self.run_dir, "checkpoints")

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.model.dtype]
        self.policy = MegatronPolicy(
            self.hf_config,
            dataclasses.replace(cfg.optim, decay_steps=cfg.optim.decay_steps or tc.max_steps * tc.minibatches_per_step),
            LossConfig(loss_agg=ac.loss_agg, clip_low=ac.clip_low, clip_high=ac.clip_high,
                       ratio_type=ac.ratio_type, kl_coef=ac.kl_coef, kl_estimator=ac.kl_estimator,
                       temperature=rc.temperature),
            params_dtype=dtype, attention=cfg.model.attention, with_reference=ac.kl_coef > 0,
            sequence_parallel=pc.sequence_parallel, recompute=pc.recompute,
            distributed_optimizer=pc.distributed_optimizer)
        self.policy.load_hf_state_dict(_load_hf_weights(cfg.model.hf_dir))
        if cfg.model.init_checkpoint:
            from megatron_dppo.megatron.checkpoint import load_checkpoint
            load_checkpoint(cfg.model.init_checkpoint, self.policy, load_optimizer=False)

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
        self.renderer = PromptRenderer(self.tokenizer, cfg.data.prompt_mode, cfg.data.system_prompt or None)
        self.data = PromptDataset(cfg.data.train, tc.prompts_per_step, seed=tc.seed, limit=cfg.data.train_size)
        self.eval_records = load_records(cfg.data.eval)[:tc.eval_size] if cfg.data.eval else []
        self.history = PromptHistory(ema=cfg.pruning.history_ema)
        self.strategy = get_strategy(cfg.pruning.strategy)
        self.scorer = RewardScorer(cfg.reward.kind, timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers)
        self.drop_zero_var = (ac.kl_coef == 0) if cfg.pruning.drop_zero_variance is None else cfg.pruning.drop_zero_variance
        self.pad_multiple = packing.thd_pad_multiple(pc.tp, 1, pc.sequence_parallel)

        self.first_step = 1
        if resume:
            self._resume()
        # The engine starts from the policy's current weights (HF dir, then synced below).
        t0 = time.perf_counter()
        self.engine = RolloutEngine(
            cfg.model.hf_dir, dtype=rc.dtype or cfg.model.dtype, max_model_len=rc.max_model_len, seed=tc.seed,
            kv_cache_memory_bytes=int(rc.kv_cache_gb * (1 << 30)) if not torch.cuda.is_available() else None,
            gpu_memory_utilization=rc.gpu_memory_utilization, tensor_parallel_size=pc.rollout_tp,
            context=suspend_cpu_compat)
        self.engine_init_s = time.perf_counter() - t0
        torch.manual_seed(tc.seed + self.rank)  # vLLM reseeded the global generators
        if tc.threads:
            torch.set_num_threads(tc.threads)
        if resume or cfg.model.init_checkpoint:
            self._sync_weights()
        if self.is_main:
            os.makedirs(self.run_dir, exist_ok=True)
            save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
        self.logger = RunLogger(self.run_dir, cfg, tc.max_steps, self.first_step, enabled=self.is_main)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        cfg, tc = self.cfg, self.cfg.trainer
        timer = PhaseTimer()
        t_step = time.perf_counter()
        gen = _step_generator(tc.seed, step)

        rollout = self._collect_rollouts(step, gen, timer)                      # prune prompts, generate, reward
        self.engine.sleep(cfg.rollout.sleep_level)  # GPU: give the KV cache (and weights) back to training
        P, G = rollout.rewards.shape
        adv = group_advantages(rollout.rewards, cfg.algorithm.advantage)        # on the FULL group
        keep_o, w_o = self.strategy.prune_completions(adv, cfg.pruning.r_o, gen)  # prune completions
        trained = keep_o.clone()
        if self.drop_zero_var:  # all-zero-advantage groups: exactly zero loss and gradient
            trained &= drop_zero_variance_groups(adv)[:, None]
        self.history.update([r.id for r in rollout.records], rollout.rewards)

        metrics = {}
        n_mini = tc.minibatches_per_step
        per_mini = tc.prompts_per_step // n_mini
        for k in range(n_mini):                                                  # pack, log-probs, update
            rows = [q for q in range(P) if rollout.batch_pos[q] // per_mini == k]
            samples = [packing.Sample(tokens=rollout.prompt_ids[q] + rollout.completions[q][i],
                                      prompt_len=len(rollout.prompt_ids[q]), advantage=float(adv[q, i]),
                                      weight=float(rollout.prompt_weight[q] * w_o[q, i]), seq_id=q * G + i)
                       for q in rows for i in range(G) if trained[q, i]]
            if not samples:  # nothing informative survived: no gradient, no optimizer step
                continue
            lengths = torch.tensor([[len(c) for c in rollout.completions[q]] for q in rows]).reshape(len(rows), G)
            denominator = losses.full_batch_denominator(
                cfg.algorithm.loss_agg, num_prompts=per_mini, group_size=G, completion_lengths=lengths,
                prompt_weight=rollout.prompt_weight[rows], max_response_length=cfg.rollout.max_new_tokens)
            microbatches, density = self._pack(samples)
            if n_mini > 1 or cfg.algorithm.kl_coef > 0:
                with timer("logprob"):
                    self._attach_logprobs(microbatches, old=n_mini > 1, ref=cfg.algorithm.kl_coef > 0)
            with timer("train"):
                m = self.policy.train_step(microbatches, denominator)
            for key, v in m.items():
                metrics.setdefault(f"train/{key}", []).append(v)
            metrics.setdefault("pack/density", []).append(density)
            metrics.setdefault("tokens/trained", []).append(sum(len(s.tokens) for s in samples))
        with timer("sync"):
            self._sync_weights()                                                 # push weights to vLLM

        out = {"step": step}
        for key, vals in metrics.items():
            out[key] = sum(vals) if key == "tokens/trained" else sum(vals) / len(vals)
        out["train/optimizer_steps"] = len(metrics.get("train/loss", []))
        for key in ("tokens/trained", "pack/density", "train/loss", "train/grad_norm"):
            out.setdefault(key, 0)  # nothing was trained this step (every group uninformative)
        r = rollout.rewards
        out.update({
            "reward/mean": float(r.mean()), "reward/accuracy": float((r >= 1.0 - 1e-6).float().mean()),
            "prune/prompts_kept_frac": rollout.info["prompts_kept"] / rollout.info["prompts_drawn"],
            "prune/completions_kept_frac": float(trained.float().mean()) if P else 0.0,
            "prune/completions_pruned_frac": float((~keep_o).float().mean()) if P else 0.0,
            "groups/zero_variance_frac": float((~drop_zero_variance_groups(adv)).float().mean()) if P else 0.0,
            "tokens/generated": rollout.info["generated_tokens"],
            "reward/timeouts": rollout.info.get("timeouts", 0), "reward/errors": rollout.info.get("errors", 0),
            "completion/mean_length": rollout.info["generated_tokens"] / max(P * G, 1),
        })
        for name in ("rollout", "reward", "logprob", "train", "sync"):
            out[f"time/{name}"] = timer.times.get(name, 0.0)
        out["time/step"] = time.perf_counter() - t_step
        return out

    # ---- the parts of a step ---------------------------------------------------------------------
    def _collect_rollouts(self, step, gen, timer) -> Rollout:
        """Draw prompts, prune them BEFORE generation, roll out G completions each, score them.
        With DAPO dynamic sampling, zero-variance groups are dropped and more prompts drawn until
        the batch is refilled (or the round limit is hit)."""
        cfg = self.cfg
        want = cfg.trainer.prompts_per_step
        acc = Rollout([], [], [], [], torch.zeros(0, cfg.rollout.group_size), torch.zeros(0),
                      {"prompts_drawn": 0, "prompts_kept": 0, "generated_tokens": 0, "timeouts": 0, "errors": 0})
        rounds = 1 + (cfg.algorithm.max_resample_rounds if cfg.algorithm.dynamic_sampling else 0)
        for rnd in range(rounds):
            records = self.data.next_batch()
            keep_q, w_q = self.strategy.prune_prompts(self.history.stats([r.id for r in records]),
                                                      cfg.pruning.r_q, gen)
            kept = keep_q.nonzero().flatten().tolist()
            acc.info["prompts_drawn"] += len(records)
            acc.info["prompts_kept"] += len(kept)
            part = self._rollout([records[i] for i in kept], seed=step * 101 + rnd, timer=timer)
            pos = kept
            if cfg.algorithm.dynamic_sampling:
                informative = (part["rewards"].std(dim=1) > 0).tolist() if len(kept) else []
                sel = [j for j, ok in enumerate(informative) if ok][: want - len(acc.records)]
                pos = [len(acc.records) + n for n in range(len(sel))]
            else:
                sel = list(range(len(kept)))
            acc.records += [records[kept[j]] for j in sel]
            acc.batch_pos += pos
            acc.prompt_ids += [part["prompt_ids"][j] for j in sel]
            acc.completions += [part["completions"][j] for j in sel]
            acc.rewards = torch.cat([acc.rewards, part["rewards"][sel]])
            acc.prompt_weight = torch.cat([acc.prompt_weight, w_q[kept][sel]])
            for key in ("generated_tokens", "timeouts", "errors"):
                acc.info[key] += part[key]
            if not cfg.algorithm.dynamic_sampling or len(acc.records) >= want:
                break
        return acc

    def _rollout(self, records, seed, timer) -> dict:
        """Each rank generates and scores its slice of `records`; the groups are gathered."""
        G = self.cfg.rollout.group_size
        mine = [records[i] for i in _my_slice(len(records))]
        prompt_ids = [self.renderer.token_ids(r) for r in mine]
        with timer("rollout"):
            outs = self.engine.generate(prompt_ids, n=G, max_new_tokens=self.cfg.rollout.max_new_tokens,
                                        temperature=self.cfg.rollout.temperature, top_p=self.cfg.rollout.top_p,
                                        seed=seed * 7919 + self.rank) if mine else []
        completions = [[c.token_ids for c in group] for group in outs]
        with timer("reward"):
            texts = [self.tokenizer.decode(c, skip_special_tokens=True) for group in completions for c in group]
            answers = [r.answer for r in mine for _ in range(G)]
            recs = [r for r in mine for _ in range(G)]
            rewards, info = self.scorer.score(texts, answers, recs) if texts else ([], {})
        local = [(p, c, rewards[q * G:(q + 1) * G]) for q, (p, c) in enumerate(zip(prompt_ids, completions))]
        counts = [sum(len(c) for g in completions for c in g), int(info.get("timeouts", 0)), int(info.get("errors", 0))]
        merged = _gather_lists(local)
        totals = _gather_lists([counts])
        return {"prompt_ids": [m[0] for m in merged], "completions": [m[1] for m in merged],
                "rewards": torch.tensor([m[2] for m in merged], dtype=torch.float32).reshape(len(merged), G),
                "generated_tokens": sum(t[0] for t in totals), "timeouts": sum(t[1] for t in totals),
                "errors": sum(t[2] for t in totals)}

    def _pack(self, samples):
        """Pack all retained sequences, spread the packs over DP ranks, build this rank's THD batches."""
        tc = self.cfg.trainer
        lengths = [packing.round_up(len(s.tokens), self.pad_multiple) for s in samples]
        capacity = tc.max_tokens_per_microbatch
        if tc.packing == "padded":
            packs = packing.pack_padded(lengths, capacity)
        elif tc.packing == "ffd":
            packs = packing.pack_ffd(lengths, capacity)
        else:
            packs = packing.pack(lengths, capacity, tc.pack_window)
        density = packing.density(lengths, packs, capacity)
        dp_rank, dp_size = self.ps.get_data_parallel_rank(), self.ps.get_data_parallel_world_size()
        mine = packing.balance_packs(packs, lengths, dp_size)[dp_rank]
        pad_id = self.tokenizer.pad_token_id or 0
        # An empty slot (fewer sequences than slots) still runs: every rank must step together.
        filler = packing.Sample(tokens=[pad_id, pad_id], prompt_len=2, weight=0.0)
        build = packing.build_padded_batch if tc.packing == "padded" else packing.build_thd_batch
        batches = [build([samples[i] for i in p] if p else [filler], pad_multiple=self.pad_multiple, pad_id=pad_id)
                   for p in mine]
        return batches, density

    def _attach_logprobs(self, microbatches, old: bool, ref: bool) -> None:
        """Old (and reference) log-probs with the same packed micro-batches, no gradients."""
        for attr, wanted, reference in (("old_logp", old, False), ("ref_logp", ref, True)):
            if not wanted:
                continue
            out = self.policy.compute_logprobs(microbatches, reference=reference)
            if out is None:  # not the last pipeline stage: the loss is computed elsewhere
                continue
            for mb, lp in zip(microbatches, out):
                setattr(mb, attr, (lp.float().cpu() * mb.loss_mask).view_as(mb.loss_mask))

    def _sync_weights(self) -> None:
        """Stream the policy's weights into vLLM. On GPU the engine wakes its weights first and
        its KV cache only after the load, so the peak stays near training's (no-ops on CPU)."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand training's cached activations back before vLLM wakes
        self.engine.wake_up(["weights"])
        self.engine.load_weights(self.policy.hf_weight_buckets())
        self.engine.wake_up(["kv_cache"])

    def evaluate(self) -> float:
        """Greedy pass@1 on the held-out prompts."""
        if not self.eval_records:
            return float("nan")
        mine = [self.eval_records[i] for i in _my_slice(len(self.eval_records))]
        outs = self.engine.generate([self.renderer.token_ids(r) for r in mine], n=1,
                                    max_new_tokens=self.cfg.rollout.max_new_tokens, temperature=0.0) if mine else []
        texts = [self.tokenizer.decode(g[0].token_ids, skip_special_tokens=True) for g in outs]
        rewards, _ = self.scorer.score(texts, [r.answer for r in mine], mine) if texts else ([], {})
        allr = _gather_lists([float(x) for x in rewards])
        return sum(1.0 for x in allr if x >= 1.0 - 1e-6) / len(allr)

    # ---- checkpoints -----------------------------------------------------------------------------
    def save(self, step: int) -> None:
        from megatron_dppo.megatron.checkpoint import save_checkpoint
        save_checkpoint(self.ckpt_dir, step, self.policy, {"data": self.data.state_dict()}, self.history,
                        keep_last=self.cfg.trainer.keep_checkpoints,
                        extra_files={"hf_config.json": os.path.join(self.cfg.model.hf_dir, "config.json")})

    def _resume(self) -> None:
        from megatron_dppo.megatron.checkpoint import latest_checkpoint, load_checkpoint
        path = latest_checkpoint(self.ckpt_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.ckpt_dir} (no 'latest' file)")
        state = load_checkpoint(path, self.policy)
        self.data.load_state_dict(state["data"])
        if "history_path" in state:
            self.history = PromptHistory.load(state["history_path"])
        self.first_step = state["step"] + 1

    # ---- the loop --------------------------------------------------------------------------------
    def train(self) -> list[dict]:
        tc = self.cfg.trainer
        history = []
        t0 = time.perf_counter()
        if self.is_main:
            self.logger.message(f"run dir {self.run_dir}; rollout engine started in {self.engine_init_s:.1f}s")
        if self.first_step == 1 and tc.eval_every:
            acc = self.evaluate()
            self.logger.log({"step": 0, "eval/accuracy": acc})
            history.append({"step": 0, "eval/accuracy": acc})
        last = self.first_step - 1
        for step in range(self.first_step, tc.max_steps + 1):
            m = self.step(step)
            last = step
            out_of_time = tc.max_time_s and time.perf_counter() - t0 > tc.max_time_s
            final = step == tc.max_steps or out_of_time
            if tc.eval_every and (step % tc.eval_every == 0 or final):
                t_eval = time.perf_counter()
                m["eval/accuracy"] = self.evaluate()
                m["time/eval"] = time.perf_counter() - t_eval
            self.logger.log(m)
            history.append(m)
            if (tc.save_every and step % tc.save_every == 0) or final:
                self.save(step)
            if _agree(bool(out_of_time)):
                self.logger.message(f"stopping after step {step}: trainer.max_time_s={tc.max_time_s} reached")
                break
        if self.is_main:
            self.logger.message(_phase_summary(history))
        self.logger.close()
        self.last_step = last
        return history

    def close(self) -> None:
        from megatron_dppo.megatron import destroy_parallel
        self.scorer.close()
        self.engine.close()
        destroy_parallel()


def _agree(flag: bool) -> bool:
    """Rank 0's decision, on every rank (wall-clock budgets differ slightly across ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.broadcast(t, 0)
    return bool(t.item())


def _phase_summary(history: list[dict]) -> str:
    steps = [h for h in history if "time/step" in h]
    if not steps:
        return "no training steps run"
    total = sum(h["time/step"] for h in steps)
    parts = ", ".join(f"{name} {sum(h.get(f'time/{name}', 0) for h in steps):.1f}s"
                      for name in ("rollout", "reward", "logprob", "train", "sync"))
    evals = [h["eval/accuracy"] for h in history if "eval/accuracy" in h]
    acc = f"; held-out accuracy {evals[0]:.3f} -> {evals[-1]:.3f}" if len(evals) > 1 else ""
    return f"{len(steps)} steps in {total:.1f}s ({parts}){acc}"


def _load_hf_weights(hf_dir: str) -> dict:
    """HF safetensors (single file or sharded with an index) -> {name: tensor}; no pickles."""
    import json

    from safetensors.torch import load_file
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.exists(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    sd = {}
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{index} names {name}, which is missing from {hf_dir}")
        sd.update(load_file(path))
    sd.pop("lm_head.weight", None) if _tied(hf_dir) else None
    return sd


def _tied(hf_dir: str) -> bool:
    import json
    with open(os.path.join(hf_dir, "config.json")) as f:
        return bool(json.load(f).get("tie_word_embeddings", False))
