"""megatron/logprobs.py's blocked log-probs against the formulation it replaced (bitwise) and a
plain log_softmax (values, gradients), and the peak memory it saves (live tensor bytes counted op by op)."""

import pytest
import torch
from loss_batches import three_sequence_batch
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_dppo.jobs import plan
from megatron_dppo.megatron import logprobs

VOCAB, PADDED = 50, 64


def _old_token_logprobs(logits, labels, temperature):
    """The replaced formulation: one fp32 scaled, masked copy of all logits fed to Megatron's CE."""
    return -vocab_parallel_cross_entropy(logprobs._scaled_masked_logits(logits, VOCAB, temperature), labels)


def _logits(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(*shape, PADDED, generator=g)).to(dtype)


def _labels(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, shape, generator=g)


def _value_and_grad(fn, logits, labels, weight):
    leaf = logits.detach().requires_grad_()
    out = fn(leaf, labels)
    (out * weight).sum().backward()
    return out.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elements", [logprobs.CHUNK_ELEMENTS, 3 * PADDED, 1])
def test_blocked_logprobs_equal_the_replaced_formulation_bitwise(tp1, dtype, temperature, chunk_elements):
    logits, labels = _logits((2, 13), dtype), _labels((2, 13))
    weight = torch.randn(2, 13)

    def new(x, y):
        return logprobs.token_logprobs(x, y, vocab_size=VOCAB, temperature=temperature, chunk_elements=chunk_elements)

    got, got_grad = _value_and_grad(new, logits, labels, weight)
    ref, ref_grad = _value_and_grad(lambda x, y: _old_token_logprobs(x, y, temperature), logits, labels, weight)
    assert got.dtype == torch.float32 and got_grad.dtype == dtype
    assert torch.equal(got, ref) and torch.equal(got_grad, ref_grad)
    assert not got_grad[..., VOCAB:].any()  # the padding columns take no probability mass

    # and a plain log_softmax over the real vocabulary, in float64
    def plain(x, y):
        return torch.log_softmax(x[..., :VOCAB].double() / temperature, -1).gather(-1, y[..., None])[..., 0]

    want, want_grad = _value_and_grad(plain, logits, labels, weight.double())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.double(), want, atol=tol, rtol=0)
    assert torch.allclose(got_grad[..., :VOCAB].double(), want_grad[..., :VOCAB].to(dtype).double(), atol=tol, rtol=0)


@pytest.mark.parametrize("chunk_elements", [logprobs.CHUNK_ELEMENTS, 5 * PADDED])
def test_detached_entropy_is_the_entropy_of_each_position(tp1, chunk_elements):
    logits, labels = _logits((1, 23), torch.float32, seed=3), _labels((1, 23), seed=4)
    logp, ent = logprobs.token_logprobs_detached_entropy(
        logits, labels, vocab_size=VOCAB, temperature=0.8, chunk_elements=chunk_elements
    )
    assert not ent.requires_grad and ent.shape == labels.shape
    # bitwise the entropy the loss used to compute on the gathered rows
    z = logprobs._scaled_masked_logits(logits.reshape(-1, PADDED), VOCAB, 0.8)
    assert torch.equal(ent.flatten(), logprobs._entropy(z))
    assert torch.equal(logp, _old_token_logprobs(logits, labels, 0.8))
    lsm = torch.log_softmax(logits[..., :VOCAB].double() / 0.8, -1)
    assert torch.allclose(ent.double(), -(lsm.exp() * lsm).sum(-1), atol=1e-5, rtol=0)
    index = torch.tensor([0, 4, 5, 22])
    total = logprobs.entropy_sum(ent, index)
    assert total.dtype == torch.float64 and float(total) == pytest.approx(float(ent.flatten()[index].double().sum()))


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created inside the mode and still alive: counted at each op's
    outputs, released when the storage is freed (a weak reference expires). The peak is exact at
    op granularity, unlike RSS, which malloc's retained pages blur."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0
        self.outside = set()  # storages that existed before the mode (the inputs, the weights)

    def _release_dead(self):
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                self.outside.add(t.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        self._release_dead()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = s.data_ptr()
                if key not in self.live and key not in self.outside and s.nbytes():
                    self.live[key] = (StorageWeakRef(s), s.nbytes())
                    self.now += s.nbytes()
        self.peak = max(self.peak, self.now)
        return out

    def measure(self):
        self._release_dead()
        return self.now


@pytest.mark.slow
def test_blocked_logprobs_keep_no_fp32_copy_of_the_logits(tp1):
    """Forward + backward of bf16 logits at 2048 x 16384 (128 MiB an fp32 copy). The replaced
    formulation keeps CE's fp32 softmax from the forward to the backward and peaks at two fp32
    copies (the scaled copy and its masked copy; in the backward the gradients of the fill and
    of the scaling); the blocked one keeps nothing and peaks at its bf16 gradient buffer and a few
    1 MiB blocks."""
    n, part, vocab = 2048, 16384, 16000
    copy_mib = n * part * 4 / 2**20
    logits = torch.randn(1, n, part).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (1, n))

    def old(x):
        return -vocab_parallel_cross_entropy(logprobs._scaled_masked_logits(x, vocab, 0.7), labels)

    def new(x):
        return logprobs.token_logprobs(x, labels, vocab_size=vocab, temperature=0.7, chunk_elements=1 << 18)

    kept, peak = {}, {}
    for name, fn in (("old", old), ("new", new)):
        leaf = logits.detach().requires_grad_()
        with LiveBytes() as live:
            out = fn(leaf)
            kept[name] = live.measure() / 2**20
            out.sum().backward()
        peak[name] = live.peak / 2**20
    peak_old, peak_new = peak["old"], peak["new"]
    print(
        f"bf16 {n} x {part}: kept after the forward: replaced {kept['old']:.0f} MiB, blocked {kept['new']:.0f} MiB; "
        f"peak over fwd+bwd: replaced {peak_old:.0f} MiB, blocked {peak_new:.0f} MiB ({copy_mib:.0f} MiB an fp32 copy)"
    )
    assert kept["old"] > 0.9 * copy_mib and peak_old > 1.8 * copy_mib, (kept, peak_old)  # the measurement sees them
    assert kept["new"] < 0.2 * copy_mib, kept
    assert peak_new < 0.75 * copy_mib, peak_new  # the bf16 gradient is half an fp32 copy
    # plan.py's logits row, less the logits themselves (they exist before the measurement)
    planned = (plan.logits_bytes(n, part, 2, block=1 << 18) - n * part * 2) / 2**20
    assert 0.9 * planned <= peak_new <= 1.1 * planned, (peak_new, planned)


def test_plan_blocks_are_the_code_s():
    assert plan.LOGPROB_BLOCK == logprobs.CHUNK_ELEMENTS


# Ops that make a CUDA device report back to the host before the host can go on: a boolean mask's
# count (nonzero, masked_select, indexing with a bool tensor) and reading a scalar. Not counted:
# `x[mask] = scalar` (index_put_ with one bool mask and a one-element host value), which torch
# runs as masked_fill_ (can_dispatch_to_masked_fill); Megatron's CE masks its targets so.
_SYNCING = {"aten.nonzero.default", "aten.masked_select.default", "aten._local_scalar_dense.default"}
_BOOL_INDEXED = {"aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"}


def _is_masked_fill(name, args) -> bool:
    value = args[2] if len(args) > 2 else None
    return name.startswith("aten.index_put") and len(args[1]) == 1 and value.numel() == 1 and value.device.type == "cpu"


def _count_syncing_ops(fn):
    seen = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if name in _SYNCING or (
                name in _BOOL_INDEXED
                and any(i is not None and i.dtype == torch.bool for i in args[1])
                and not _is_masked_fill(name, args)
            ):
                seen.append(name)
            return func(*args, **(kwargs or {}))

    with Count():
        out = fn()
    return out, seen


def test_loss_gathers_its_tokens_without_a_host_sync(tp1, monkeypatch):
    """The loss tokens' positions come from the host mask (loss_positions, computed here before
    the count); the loss itself indexes with them: no boolean-mask gather on the device. Its
    log-probs, token count and entropy sum against a plain log_softmax over the masked positions."""
    from megatron_dppo.config import AlgorithmConfig
    from megatron_dppo.megatron import loss as loss_mod

    batch = three_sequence_batch()
    host_index = loss_mod.loss_positions(batch.loss_mask)
    monkeypatch.setattr(loss_mod, "loss_positions", lambda mask: host_index)
    logits = _logits(tuple(batch.labels.shape), torch.float32, seed=6).requires_grad_()
    algorithm = AlgorithmConfig(kl_coef=0.05)
    (loss, n_tokens, report), seen = _count_syncing_ops(
        lambda: loss_mod.micro_batch_loss(
            batch, logits, algorithm=algorithm, vocab_size=VOCAB, temperature=0.9, mode="train", denominator=40.0
        )
    )
    assert seen == [], seen
    mask = batch.loss_mask.flatten() > 0
    assert int(n_tokens) == int(mask.sum()) == float(report["tokens"]) == 4 + 3 + 4
    lsm = torch.log_softmax(logits.detach()[..., :VOCAB].double() / 0.9, -1).reshape(-1, VOCAB)
    want_entropy = -(lsm.exp() * lsm).sum(-1)[mask].sum()
    assert float(report["entropy_sum"]) == pytest.approx(float(want_entropy), abs=1e-5)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
