"""Kernel output buffers that tests can poison.

Every Triton op allocates its outputs through :func:`empty` / :func:`empty_like`. The test suite sets
``POISON_OUTPUTS`` (``tests/conftest.py``), so each buffer is filled with NaN before the launch and an element a
kernel forgets to write shows as NaN; in training the buffers stay uninitialised (a fill costs a full write)."""

from __future__ import annotations

import torch

POISON_OUTPUTS = False


def empty(*shape, device, dtype) -> torch.Tensor:
    out = torch.empty(*shape, device=device, dtype=dtype)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def empty_like(t: torch.Tensor, **kw) -> torch.Tensor:
    out = torch.empty_like(t, **kw)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out
