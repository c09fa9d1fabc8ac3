"""The README's "Adding a mechanism", followed by a mechanism written here: a decayed linear attention with its own
options dataclass, registered with ``register_attention`` (and unregistered after each test, so no other test sees
it). It gets its ``[attention.tiny_linear]`` table, shows in ``--list-attention``, compiles with ``fullgraph=True``
and goes through the conformance matrix's lifecycle (``tests/test_conformance.py``): two training processes from a
meta build, the checkpoint read back as the tools read it, HF export and import, decoding with its cache.

Run as a module (``python -m tests.attention.test_adding_a_mechanism <train.py arguments>``), it registers the
mechanism and runs ``train.py``: the training processes of the lifecycle test.
"""

from __future__ import annotations

import math
import runpy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchtitan.models.utils import trunc_normal_

from attnlab.attention.base import AttentionArgs, AttentionContext
from attnlab.attention.ops.common import check_impl
from attnlab.attention.ops.linear_attn import gated_linear_attention
from attnlab.attention.registry import REGISTRY, register_attention

NAME = "tiny_linear"


@dataclass
class TinyLinearOptions:
    decay: float = 0.9
    """Per-token decay γ of the state, in (0, 1]; 1 is plain linear attention."""


class TinyLinearAttention(nn.Module):
    """Decayed linear attention: h_t = γ h_{t-1} + φ(k_t) v_tᵀ, o_t = h_tᵀ φ(q_t) / √D, φ = elu + 1."""

    impls = ("auto", "reference", "chunk")
    """``[attention] impl`` values it accepts: the paths of :func:`attention.ops.linear_attn.gated_linear_attention`
    that carry a decode state."""

    def __init__(self, args: AttentionArgs, opts: TinyLinearOptions):
        super().__init__()
        check_impl(args.impl, self.impls, self.mechanism)
        if not 0 < opts.decay <= 1:
            raise ValueError(f"attention.{NAME}.decay={opts.decay} must be in (0, 1]")
        self.args, self.opts = args, opts
        self.n_heads, self.head_dim = args.n_heads, args.head_dim
        inner = args.n_heads * args.head_dim
        self.wq, self.wk, self.wv = (nn.Linear(args.dim, inner, bias=False) for _ in range(3))
        self.wo = nn.Linear(inner, args.dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            trunc_normal_(lin.weight, mean=0.0, std=0.02)
        trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def init_cache(self, batch_size: int, max_len: int, device, dtype) -> dict:
        """The recurrent state [B, H, D, D] (fp32), all the decoding step needs."""
        return {"state": torch.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device)}

    def flops_per_token(self, seq_len: int) -> int:
        # state readout and update, 2·D·D multiply-adds per head (the chunked form's intra-chunk terms left out)
        return 2 * 2 * self.n_heads * self.head_dim * self.head_dim

    def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.n_heads, self.head_dim) for p in (self.wq, self.wk, self.wv))
        q, k = F.elu(q) + 1, F.elu(k) + 1
        g = torch.full((B, T, self.n_heads), math.log(self.opts.decay), device=x.device)
        if ctx.cache is None:
            o, _ = gated_linear_attention(q, k, v, g, cu_seqlens=ctx.cu_seqlens, impl=self.args.impl)
        else:
            o, ctx.cache["state"] = gated_linear_attention(q, k, v, g, initial_state=ctx.cache["state"],
                                                           output_final_state=True, impl=self.args.impl)
        return self.wo(o.reshape(B, T, -1))


def register() -> None:
    register_attention(NAME, options=TinyLinearOptions, description="tiny decayed linear attention (a test)")(
        TinyLinearAttention)


@pytest.fixture
def tiny():
    register()
    yield NAME
    REGISTRY.pop(NAME)


def test_registered_only_inside_the_test(tiny):
    assert tiny in REGISTRY


def test_not_registered_outside_the_tests():
    assert NAME not in REGISTRY


def test_config_section_and_list(tiny):
    from attnlab import attention
    from attnlab.config import DEFAULT_CONFIG, parse_config

    cfg = parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.attention", tiny,
                        f"--attention.{tiny}.decay", "0.5"])
    assert cfg.attention.tiny_linear == TinyLinearOptions(decay=0.5)
    row = next(line for line in attention.describe().splitlines() if line.split()[0] == tiny)
    assert "auto | reference | chunk" in row and "tiny decayed linear attention" in row
    with pytest.raises(ValueError, match="attention.impl='triton' is not valid for tiny_linear"):
        attention.build_attention(tiny, AttentionArgs(dim=32, n_heads=2, n_kv_heads=2, head_dim=16, impl="triton"))


def test_compiles_with_fullgraph(tiny):
    from tests.attention.test_compile_fullgraph import _check

    _check(tiny, "auto")


def test_conformance_lifecycle(tiny, corpus, tmp_path):
    from tests.test_conformance import check_lifecycle

    check_lifecycle((tiny,), corpus, tmp_path, module=__name__)


if __name__ == "__main__":  # a training process of test_conformance_lifecycle: register, then train.py
    import sys

    from tests.utils import REPO

    register()
    sys.argv[0] = str(REPO / "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
