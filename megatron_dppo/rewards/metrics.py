"""The trainer's per-source reward metrics: pure functions over one step's completions."""

from __future__ import annotations

import statistics

from megatron_dppo.rewards.spec import data_source_of

NO_SOURCE = "unknown"  # the name of records without a data_source, when others have one


def reward_metrics_by_source(rewards: list[float], records: list, extras: list[dict] | None = None) -> dict:
    """{"reward/<source>/mean": the mean reward of the source's completions,
        "reward/<source>/<name>": the mean of extra <name> over the source's completions that
        returned it} (extras: RewardScorer.score's info["extras"]). One record per completion,
    as passed to score(). {} when no record has a data_source (reward/mean says it all)."""
    if len(records) != len(rewards) or (extras is not None and len(extras) != len(rewards)):
        raise ValueError(
            f"got {len(rewards)} rewards, {len(records)} records, {None if extras is None else len(extras)} extras"
        )
    sources = [data_source_of(r) for r in records]
    if not any(sources):
        return {}
    rewards_of: dict[str, list[float]] = {}
    extras_of: dict[str, dict[str, list[float]]] = {}
    for i, src in enumerate(sources):
        src = src or NO_SOURCE
        rewards_of.setdefault(src, []).append(float(rewards[i]))
        for name, value in (extras[i] if extras is not None else {}).items():
            extras_of.setdefault(src, {}).setdefault(name, []).append(float(value))
    out = {}
    for src in sorted(rewards_of):
        out[f"reward/{src}/mean"] = statistics.fmean(rewards_of[src])
        for name, values in sorted(extras_of.get(src, {}).items()):
            out[f"reward/{src}/{name}"] = statistics.fmean(values)
    return out
