"""Every registered mechanism is causal and keeps packed documents apart, on every device's default path.

Changing the input at positions after t must leave every output at or before t unchanged, and changing one packed
document must leave the others unchanged. A leak makes a mechanism look better than it is (its training loss sees
the answer), so the mechanism table would rank it first for the wrong reason; this is the property that would catch
it, with the float64 references of each kernel's own tests covering the numbers.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.attention import REGISTRY, build_attention
from attnlab.attention.base import AttentionArgs, AttentionContext

T, CUT = 40, 23  # a cut that is no multiple of any block; the second document starts at CUT
DIM, HEADS, KV, HD = 64, 4, 2, 16


def _module(name: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    m = build_attention(name, AttentionArgs(dim=DIM, n_heads=HEADS, n_kv_heads=KV, head_dim=HD, impl="auto"),
                        REGISTRY[name].options())
    with torch.no_grad():
        m.init_weights(0.02)
    return m.to(device=device, dtype=dtype).eval()


def _outputs(m, x: torch.Tensor, block: bool) -> torch.Tensor:
    pos = torch.arange(T, device=x.device)
    if block:
        pos = torch.cat([torch.arange(CUT, device=x.device), torch.arange(T - CUT, device=x.device)])
    ctx = AttentionContext.from_positions(pos.expand(x.shape[0], T), block_causal=block, rope_theta=1e6)
    with torch.no_grad():
        return m(x, ctx).float()


def _check(name: str, device: str, dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    m = _module(name, device, dtype)
    x = torch.randn(2, T, DIM, device=device, dtype=dtype)
    later = x.clone()
    later[:, CUT:] = torch.randn_like(later[:, CUT:])
    base, moved = _outputs(m, x, block=False), _outputs(m, later, block=False)
    atol = tol * base.abs().max().item()  # outputs are ~0.02-0.6 at this init: the tolerance scales with them
    # the check can see a change of the size a leak would make: the outputs after CUT did move
    assert (moved - base)[:, CUT:].abs().max() > 5 * atol, f"{name}: the inputs after CUT moved no output"
    # causal: outputs before CUT see only inputs before CUT
    torch.testing.assert_close(moved[:, :CUT], base[:, :CUT], rtol=tol, atol=atol)
    # documents: a change in the first document leaves the second one's outputs alone
    earlier = x.clone()
    earlier[:, :CUT] = torch.randn_like(earlier[:, :CUT])
    torch.testing.assert_close(_outputs(m, earlier, block=True)[:, CUT:], _outputs(m, x, block=True)[:, CUT:],
                               rtol=tol, atol=atol)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_causal_and_documents_apart(name):
    _check(name, "cpu", torch.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_causal_and_documents_apart_gpu(name):
    """The CUDA "auto" paths: fla-core, FlexAttention and the project's Triton kernels, in bf16."""
    _check(name, "cuda", torch.bfloat16, 1e-2)
