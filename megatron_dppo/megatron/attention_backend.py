"""Which attention path a model is built with (model.attention), and why.

  "te"     Transformer Engine layer spec (fused kernels, THD varlen attention); needs CUDA + TE.
  "local"  Megatron-Core's local spec with megatron/attention.py's packed attention; runs anywhere.
  "auto"   "te" where it can work for this run, else "local".

`choose_attention` is the decision, a pure function of the facts (requested value, dtype, TE
version or None, CUDA, layout), so every case is tested on a machine without a GPU;
`attention_choice` gathers the facts of this process and calls it. The rules:
  - TE needs CUDA and an importable transformer_engine.pytorch (`te_status` says which of "not
    installed" / "installed but fails to import" it is, keeping the import's own reason: a TE
    whose compiled parts no longer load after pip replaced torch must not pass for "absent").
  - TE before 2.11 has no attention backend for float32 packed (THD) sequences: FlashAttention
    and cuDNN take 16-bit only and its unfused attention refuses THD ("No dot product attention
    backend is available"). auto picks local there; an explicit te is an error.
  - sequence parallelism (tp > 1) needs TE (the local spec has no sequence-parallel norm):
    when TE cannot be used, that is an error naming both keys and the reason.
Errors are ValueErrors naming the config key and why, in one line.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata

import torch
from packaging.version import InvalidVersion, Version

ATTENTION_CHOICES = ("auto", "te", "local")
TE_FP32_THD_MIN = (2, 11)  # first Transformer Engine release with a float32 THD backend


@dataclasses.dataclass(frozen=True)
class TeStatus:
    """version: the importable Transformer Engine's version (None: not usable here);
    reason: why not (None when usable)."""

    version: str | None
    reason: str | None


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    backend: str  # "te" or "local"
    reason: str  # one line: why this backend (printed once at start-up)

    def describe(self) -> str:
        return f"attention: {self.backend} ({self.reason})"


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def te_import_status() -> TeStatus:
    """Does transformer_engine.pytorch import? Distinguishes not installed (the package itself
    is missing) from installed but broken (any other failure: a missing shared library, a torch
    ABI mismatch, a missing dependency), whose reason is kept."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "transformer_engine":
            return TeStatus(None, "transformer_engine is not installed")
        return TeStatus(None, f"transformer_engine is installed but does not import ({_first_line(e)})")
    except Exception as e:  # without a usable GPU stack it fails with OSError (cudnn), ImportError...
        return TeStatus(None, f"transformer_engine is installed but does not import ({_first_line(e)})")
    import transformer_engine

    version = getattr(transformer_engine, "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version("transformer-engine")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    return TeStatus(str(version), None)


@functools.cache
def te_status() -> TeStatus:
    """TE's usability in this process (cached: the import is tried once)."""
    if not torch.cuda.is_available():
        return TeStatus(None, "no CUDA device")
    return te_import_status()


def te_available() -> bool:
    return te_status().version is not None


def _release(version: str) -> tuple[int, ...]:
    try:
        return Version(version).release
    except InvalidVersion:
        return ()  # unknown: treated as older than any threshold


def choose_attention(
    requested: str,
    *,
    dtype: torch.dtype,
    te_version: str | None,
    te_reason: str | None = None,
    sequence_parallel: bool = False,
    packed: bool = True,
) -> AttentionChoice:
    """The attention backend for these facts (module docstring). te_version None means TE is not
    usable, te_reason says why; sequence_parallel: parallel.sequence_parallel with tp > 1;
    packed: micro-batches are THD rows (the trainer's default; False for trainer.packing=padded)."""
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"model.attention must be one of {', '.join(ATTENTION_CHOICES)}, not {requested!r}")
    blocker = None  # why TE cannot run this model
    if te_version is None:
        blocker = f"Transformer Engine not usable: {te_reason or 'unknown reason'}"
    elif dtype == torch.float32 and packed and _release(te_version) < TE_FP32_THD_MIN:
        need = ".".join(map(str, TE_FP32_THD_MIN))
        blocker = (
            f"Transformer Engine {te_version} has no float32 attention backend for packed sequences "
            f"(needs >= {need}; or model.dtype=bfloat16)"
        )
    if requested == "te" and blocker:
        raise ValueError(f"model.attention=te cannot work here: {blocker}; use model.attention=auto or local")
    if sequence_parallel and (requested == "local" or blocker):
        why = "model.attention=local" if requested == "local" else blocker
        raise ValueError(
            "parallel.sequence_parallel needs the Transformer Engine attention path (the local spec has "
            f"no sequence-parallel norm), but {why}: set parallel.sequence_parallel=false"
        )
    if requested == "local":
        return AttentionChoice("local", "model.attention=local")
    if blocker:
        return AttentionChoice("local", blocker)
    return AttentionChoice("te", f"Transformer Engine {te_version}")


def attention_choice(
    requested: str = "auto", *, dtype: torch.dtype | None = None, sequence_parallel: bool = False, packed: bool = True
) -> AttentionChoice:
    """choose_attention with this process's facts. dtype None (a caller that does not say):
    decided as for 16-bit, the dtype-blind choice of earlier versions."""
    status = te_status()
    return choose_attention(
        requested,
        dtype=torch.bfloat16 if dtype is None else dtype,
        te_version=status.version,
        te_reason=status.reason,
        sequence_parallel=sequence_parallel,
        packed=packed,
    )
