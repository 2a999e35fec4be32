"""The weight sync: after every update the rollout engines get the policy's new weights.

Full fine-tuning streams every weight (HF names, in buckets) into the colocated engine, or from
training rank 0 over the weights bridge to the dedicated rollout ranks.

LoRA sends the adapters only. The engine starts with the frozen base (the run's first sync streams
it whole); every sync then writes the adapters (HF names, whole over TP/PP/EP) as a PEFT adapter
directory (model/peft_dir.py, stamped with the step) into a temporary directory this process
creates and removes, and the engine loads it in place (RolloutEngine.load_adapter), checking that
what vLLM serves is what was written: the sync that silently did not arrive is an error here. With
dedicated rollout ranks the adapters travel over the weights bridge as one bucket and each rollout
rank writes its own directory.
"""

from __future__ import annotations

import shutil
import tempfile

import torch

from megatron_dppo.config import Config
from megatron_dppo.model.peft_dir import hf_modules, write_peft_adapter

TEMP_PREFIX = "megatron-dppo-lora-"  # the directories AdapterSync makes (and only they are removed)


class AdapterSync:
    """This process's adapter directory and the loads into its engine."""

    def __init__(self, cfg: Config):
        self.lora, self.base_model = cfg.model.lora, cfg.model.hf_dir
        self.directory = tempfile.mkdtemp(prefix=TEMP_PREFIX)

    def load(self, engine, tensors: dict, version: int) -> dict:
        """Write step `version`'s adapters and have the engine serve them; -> the load's stats
        (seconds, num_tensors, num_bytes, ...)."""
        path = write_peft_adapter(
            self.directory,
            tensors,
            rank=self.lora.rank,
            alpha=self.lora.alpha,
            dropout=self.lora.dropout,
            target_modules=hf_modules(self.lora.targets),
            base_model=self.base_model,
            version=version,
        )
        return engine.load_adapter(path, version)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)  # made by mkdtemp above: ours alone


def merged_buckets(buckets, adapters: dict, scale: float):
    """The base's HF buckets with each adapted module's weight merged: W + scale B A (in fp32, cast
    back), what PEFT's merge_and_unload computes; vLLM then serves the policy without LoRA."""
    for bucket in buckets:
        out = []
        for name, t in bucket:
            module = name.removesuffix(".weight")
            a = adapters.get(f"{module}.lora_A.weight")
            if a is not None:
                b = adapters[f"{module}.lora_B.weight"]
                t = (t.float() + scale * (b.float() @ a.float()).to(t.device)).to(t.dtype)
            out.append((name, t))
        yield out


class WeightSync:
    """Pushes the policy's weights to wherever this run generates, after every update.
    engine: this rank's colocated RolloutEngine, or None with dedicated rollout ranks (roles)."""

    def __init__(self, cfg: Config, policy, *, engine, engines, roles):
        self.policy, self.engine, self.engines, self.roles = policy, engine, engines, roles
        lora = policy.adapters is not None
        self.merged = lora and cfg.model.lora.sync == "merged"  # W + alpha/r B A as full weights
        self.lora = lora and not self.merged  # the adapters alone, into vLLM's LoRA slot
        self.scale = cfg.model.lora.alpha / cfg.model.lora.rank if lora else 0.0
        self.adapter_sync = AdapterSync(cfg) if self.lora and engine is not None else None
        self.bytes = 0  # the last sync's: what this rank sent or loaded (sync/bytes)

    def describe(self) -> str:
        """For the start-up line: what a LoRA run's sync sends ("" without LoRA)."""
        if self.merged:
            return "; LoRA: merged weights synced to vLLM (model.lora.sync=merged)"
        return "; LoRA: adapters synced to vLLM's LoRA slot (model.lora.sync=adapters)" if self.lora else ""

    def push(self, version: int, start: bool = False) -> None:
        """Step `version`'s weights to the engines. start: the run's first sync (LoRA: the base too)."""
        if start or not self.lora:
            self._full(version)
        if self.lora:
            self._adapters(version)

    def _full(self, version: int) -> None:
        """Every weight, streamed in buckets. Colocated, on GPU the engine wakes its weights first and
        its KV cache only after the load, so the peak stays near training's (no-ops on CPU). Rollout
        ranks: training rank 0 sends; every training rank takes part in gathering the buckets."""
        buckets = self.policy.hf_weight_buckets()
        if self.merged:
            buckets = merged_buckets(buckets, self.policy.hf_adapters(), self.scale)
        if self.roles is not None:
            if self.roles.control is None:
                for _ in buckets:  # the TP/PP gathers are collective: rank 0 sends what they give
                    pass
                return
            self.roles.control.broadcast_object(("weights", version))
            stats = {}
            self.roles.weights.send_buckets(buckets, stats)
            self.bytes = stats["num_bytes"]
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand training's cached activations back before vLLM wakes
        self.engine.wake_up(["weights"])
        self.bytes = self.engine.load_weights(buckets)["num_bytes"]
        self.engine.wake_up(["kv_cache"])
        self.engines.set_weights_version(version)

    def _adapters(self, version: int) -> None:
        """LoRA: the adapters (whole, on every rank: a collective) into this rank's engine, or from
        training rank 0 over the weights bridge to the rollout ranks as one bucket."""
        tensors = self.policy.hf_adapters()
        if self.roles is not None:
            if self.roles.control is not None:
                self.roles.control.broadcast_object(("adapters", version))
                self.roles.weights.send_buckets([list(tensors.items())])
            self.bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            return
        self.engine.wake_up(["weights"])  # GPU: the base (a level-1 sleep) back before its adapters
        self.bytes = self.adapter_sync.load(self.engine, tensors, version)["num_bytes"]
        self.engine.wake_up(["kv_cache"])
        self.engines.set_weights_version(version)

    def close(self) -> None:
        if self.adapter_sync is not None:
            self.adapter_sync.close()
