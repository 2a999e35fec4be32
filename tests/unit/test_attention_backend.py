"""model.attention: which backend a model gets (megatron/attention_backend.py), decided from facts
given as arguments, so the GPU cases run here; and how a missing or broken Transformer Engine
import is told apart (fake transformer_engine packages on sys.path)."""

import sys

import pytest
import torch

from megatron_dppo.megatron import attention_backend as ab

F32, BF16 = torch.float32, torch.bfloat16
NO_TE = dict(te_version=None, te_reason="transformer_engine is not installed")

# (requested, dtype, TE facts, layout) -> backend, and a fragment of the reason it gives
CHOICES = [
    ("auto", BF16, dict(te_version="2.10.0"), {}, "te", "Transformer Engine 2.10.0"),
    ("auto", F32, dict(te_version="2.10.0"), {}, "local", "no float32 attention backend for packed"),
    ("auto", F32, dict(te_version="2.9.0+abc123"), {}, "local", "needs >= 2.11"),
    ("auto", F32, dict(te_version="2.11.0"), {}, "te", "Transformer Engine 2.11.0"),
    ("auto", F32, dict(te_version="2.12.0.dev0+f00"), {}, "te", "Transformer Engine 2.12.0.dev0"),
    ("auto", F32, dict(te_version="2.10.0"), dict(packed=False), "te", "Transformer Engine 2.10.0"),
    ("auto", F32, dict(te_version="garbage"), {}, "local", "no float32 attention backend"),
    ("auto", BF16, NO_TE, {}, "local", "not installed"),
    ("auto", F32, dict(te_version=None, te_reason="no CUDA device"), {}, "local", "no CUDA device"),
    ("te", BF16, dict(te_version="2.10.0"), {}, "te", "Transformer Engine 2.10.0"),
    ("te", F32, dict(te_version="2.11.1"), {}, "te", "Transformer Engine 2.11.1"),
    ("te", BF16, dict(te_version="2.10.0"), dict(sequence_parallel=True), "te", "Transformer Engine"),
    ("local", BF16, dict(te_version="2.10.0"), {}, "local", "model.attention=local"),
    ("local", F32, NO_TE, {}, "local", "model.attention=local"),
]


@pytest.mark.parametrize("requested, dtype, te, layout, backend, why", CHOICES)
def test_choose_attention(requested, dtype, te, layout, backend, why):
    got = ab.choose_attention(requested, dtype=dtype, **te, **layout)
    assert got.backend == backend and why in got.reason, got
    assert "\n" not in got.describe() and got.describe().startswith(f"attention: {backend} (")


# (requested, dtype, TE facts, layout) -> a ValueError naming the key and the reason
ERRORS = [
    ("te", F32, dict(te_version="2.10.0"), {}, r"model\.attention=te cannot work here: .*2\.10\.0 has no float32"),
    ("te", BF16, NO_TE, {}, r"model\.attention=te cannot work here: .*transformer_engine is not installed"),
    (
        "te",
        BF16,
        dict(te_version=None, te_reason="transformer_engine is installed but does not import (OSError: libcudnn)"),
        {},
        r"cannot work here: .*installed but does not import \(OSError: libcudnn\)",
    ),
    ("auto", BF16, NO_TE, dict(sequence_parallel=True), r"parallel\.sequence_parallel needs .*not installed"),
    ("auto", F32, dict(te_version="2.10.0"), dict(sequence_parallel=True), r"sequence_parallel needs .*float32"),
    ("local", BF16, dict(te_version="2.10.0"), dict(sequence_parallel=True), r"but model\.attention=local"),
    ("flash", BF16, dict(te_version="2.10.0"), {}, r"model\.attention must be one of auto, te, local, not 'flash'"),
]


@pytest.mark.parametrize("requested, dtype, te, layout, match", ERRORS)
def test_choose_attention_errors_name_the_key_and_why(requested, dtype, te, layout, match):
    with pytest.raises(ValueError, match=match) as e:
        ab.choose_attention(requested, dtype=dtype, **te, **layout)
    assert "\n" not in str(e.value)


def _fake_te(root, init_body: str, with_pytorch: bool = True):
    pkg = root / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(init_body)
    if with_pytorch:
        (pkg / "pytorch").mkdir()
        (pkg / "pytorch" / "__init__.py").write_text("")


@pytest.fixture
def clean_te(monkeypatch):
    """No transformer_engine module cached; whatever a test imports is dropped afterwards."""
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]


def test_te_not_installed(tmp_path, monkeypatch, clean_te):
    monkeypatch.setattr(sys, "path", [str(tmp_path)])  # a path with no transformer_engine anywhere
    assert ab.te_import_status() == ab.TeStatus(None, "transformer_engine is not installed")


@pytest.mark.parametrize(
    "init_body, with_pytorch, reason",
    [
        # pip replaced torch under TE: its extension no longer loads (what the issue saw)
        ("raise OSError('libtransformer_engine.so: undefined symbol: _ZN3c10')", True, "OSError: libtransformer"),
        ("import transformer_engine_torch_missing_dep", True, "No module named 'transformer_engine_torch_missing_dep'"),
        ("", False, "No module named 'transformer_engine.pytorch'"),  # core without the torch part
    ],
)
def test_broken_te_keeps_its_reason(tmp_path, monkeypatch, clean_te, init_body, with_pytorch, reason):
    _fake_te(tmp_path, init_body, with_pytorch)
    monkeypatch.syspath_prepend(str(tmp_path))
    status = ab.te_import_status()
    assert status.version is None
    assert status.reason.startswith("transformer_engine is installed but does not import (") and reason in status.reason


def test_working_te_reports_its_version(tmp_path, monkeypatch, clean_te):
    _fake_te(tmp_path, "__version__ = '2.10.0+e1a2b3c'")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ab.te_import_status() == ab.TeStatus("2.10.0+e1a2b3c", None)


def test_te_status_without_cuda_and_the_process_choice(monkeypatch):
    """This process (no GPU): auto is local and says why; te is the named error; te_status is
    tried once and then cached."""
    ab.te_status.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ab.te_status() == ab.TeStatus(None, "no CUDA device")
    choice = ab.attention_choice("auto", dtype=F32)
    assert choice.backend == "local" and "no CUDA device" in choice.describe()
    with pytest.raises(ValueError, match="model.attention=te cannot work here: .*no CUDA device"):
        ab.attention_choice("te", dtype=BF16)
    ab.te_status.cache_clear()
