"""attnlab/models/loss.py: the chunked linear cross-entropy against torchtitan's loss of the full logits (value and
every gradient; ignored labels, ragged last chunks, fp32 and bf16), that no tensor holds more than a chunk of logits,
and the model's loss path (tied and untied head) against its logits path for every parameter."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_loss

from attnlab.models.args import ModelArgs
from attnlab.models.loss import linear_cross_entropy
from attnlab.models.model import Transformer

T, V, D = 74, 211, 8  # D·V and T·D below 16·V below T·V: the memory checks tell a chunk of logits from all of them


def _inputs(dtype=torch.float32):
    h = torch.randn(T, D, dtype=dtype, requires_grad=True)
    w = (0.5 * torch.randn(V, D, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, V, (T,))
    labels[[0, 3, 17]] = IGNORE_INDEX
    labels[32:48] = IGNORE_INDEX  # a whole chunk of 16 ignored
    return h, w, labels


def _reference(h, w, labels):
    """torchtitan's loss of the full logits, as the trainer scales it (1 / the valid token count)."""
    return cross_entropy_loss(F.linear(h, w).unsqueeze(0), labels.unsqueeze(0))


def _loss_and_grads(fn, h, w, labels):
    h, w = (t.detach().clone().requires_grad_() for t in (h, w))
    loss = fn(h, w, labels)
    (loss / (labels != IGNORE_INDEX).sum()).backward()
    return loss.detach(), h.grad, w.grad


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("chunk", [1, 16, 25, 74, 100], ids=lambda n: f"T{T}-V{V}-D{D}-N{n}")
def test_chunks_give_the_loss_and_gradients_of_the_full_logits(chunk):
    """N = 25 leaves a last chunk of 24, N = 100 one chunk larger than T."""
    h, w, labels = _inputs()
    want = _loss_and_grads(_reference, h, w, labels)
    got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, chunk), h, w, labels)
    assert got[0].dtype == torch.float32
    for name, a, b in zip(("loss", "grad h", "grad W"), got, want):
        assert _rel(a, b) < 2e-6, (name, _rel(a, b))
    assert torch.all(got[1][labels == IGNORE_INDEX] == 0)  # an ignored row gets no gradient
    with torch.no_grad():  # no autograd: the loss alone
        assert _rel(linear_cross_entropy(h, w, labels, chunk), want[0]) < 2e-6


@pytest.mark.parametrize("mode", ["autocast", "bf16-weights"])
def test_bf16_matches_the_full_logits_in_bf16(mode):
    """The logits in bf16 (under autocast, as on one GPU, or from bf16 weights and inputs, as under FSDP's mixed
    precision), upcast to fp32 as torchtitan does. bf16 is looser: grad W sums each chunk's product rounded to bf16
    where the full path rounds one product."""
    h, w, labels = _inputs(torch.float32 if mode == "autocast" else torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        want = _loss_and_grads(_reference, h, w, labels)
        got = _loss_and_grads(lambda *a: linear_cross_entropy(*a, 16), h, w, labels)
    for name, a, b in zip(("loss", "grad h", "grad W"), got, want):
        assert a.dtype == b.dtype and _rel(a, b) < 1e-2, (name, a.dtype, b.dtype, _rel(a, b))


class _LargestOutput(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _memory(fn) -> tuple[int, int]:
    """(the largest tensor made in the forward and backward, the elements saved for the backward) of ``fn``'s loss."""
    h, w, labels = _inputs()
    saved = []
    with _LargestOutput() as mode:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            loss = fn(h, w, labels)
        loss.backward()
    return mode.largest, sum(saved)


def test_no_tensor_holds_more_than_a_chunk_of_logits():
    largest, saved = _memory(lambda *a: linear_cross_entropy(*a, 16))
    assert largest <= 16 * V and saved <= T * D + V * D, (largest, saved)
    largest, saved = _memory(_reference)  # the checks see the full logits where they exist
    assert largest >= T * V and saved >= T * V


def test_bad_inputs_are_named():
    h, w, labels = _inputs()
    with pytest.raises(ValueError, match="chunk_tokens=0: must be > 0"):
        linear_cross_entropy(h, w, labels, 0)
    with pytest.raises(ValueError, match=r"expected h \[T, D\], weight \[V, D\], labels \[T\]; got h \[1, 74, 8\]"):
        linear_cross_entropy(h.unsqueeze(0), w, labels, 16)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_models_loss_path_gives_every_parameters_gradient(tied):
    """``model(tokens, labels=..., loss_chunk_tokens=N)`` against torchtitan's loss of ``model(tokens)``: 2 rows of
    19 tokens in chunks of 8 (a last chunk of 6), some labels ignored."""
    args = ModelArgs(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, hidden_dim=64, vocab_size=97,
                     max_seq_len=32, enable_weight_tying=tied)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    assert (model.output.weight is model.tok_embeddings.weight) == tied
    tokens, labels = torch.randint(0, 97, (2, 19)), torch.randint(0, 97, (2, 19))
    labels[0, :5] = labels[1, -1] = IGNORE_INDEX
    n = (labels != IGNORE_INDEX).sum()

    logits = model(tokens)
    assert logits.shape == (2, 19, 97)  # the plain forward keeps returning the logits
    want = cross_entropy_loss(logits, labels)
    (want / n).backward()
    want_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    got = model(tokens, labels=labels, loss_chunk_tokens=8)
    (got / n).backward()
    assert _rel(got.detach(), want.detach()) < 2e-6
    for k, p in model.named_parameters():
        assert _rel(p.grad, want_grads[k]) < 1e-5, (k, _rel(p.grad, want_grads[k]))


@pytest.mark.gpu
def test_qwen3_head_on_cuda_in_bf16_in_less_memory():
    """Qwen3's head (V = 151,936, D = 1024) over 16,384 tokens in bf16 on CUDA, in chunks of 1,024: the loss and
    gradients of the full logits, and the forward and backward's peak memory above their inputs under the bf16
    logits of all tokens (2·T·V bytes), which the full path exceeds."""
    T, V, D, N = 16384, 151936, 1024, 1024
    h = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    w = 0.03 * torch.randn(V, D, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, V, (T,), device="cuda")
    labels[::7] = IGNORE_INDEX
    peaks, results = [], []
    for fn in (_reference, lambda *a: linear_cross_entropy(*a, N)):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        results.append(_loss_and_grads(fn, h, w, labels))
        peaks.append(torch.cuda.max_memory_allocated() - base)
    for name, a, b in zip(("loss", "grad h", "grad W"), results[1], results[0]):
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))
    assert peaks[1] < 2 * T * V < peaks[0], peaks
