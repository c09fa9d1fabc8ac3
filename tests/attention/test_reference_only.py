"""Mechanisms without a fast path are marked reference-only in ``--list-attention`` and warn when built."""

import logging

from attnlab.attention.base import AttentionArgs
from attnlab.attention.registry import REGISTRY, build_attention, describe


def test_reference_only_is_listed_and_warns(caplog):
    slow = [n for n, m in REGISTRY.items() if m.reference_only]
    assert "affine_mesa" in slow and "softmax" not in slow
    line = next(x for x in describe().splitlines() if x.startswith("affine_mesa "))
    assert "[reference only:" in line and "tok/s" in line
    args = AttentionArgs(dim=32, n_heads=2, n_kv_heads=2, head_dim=16)
    with caplog.at_level(logging.WARNING):
        build_attention("affine_mesa", args)
        build_attention("softmax", args)
    assert [r.getMessage() for r in caplog.records if "reference-only" in r.getMessage()] == [
        f"attention 'affine_mesa' is reference-only: {REGISTRY['affine_mesa'].reference_only}"]
