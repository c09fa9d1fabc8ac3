"""The model only: a Qwen3-style transformer whose attention block comes from the registry (``attnlab.attention``),
its args and flavors, the head's chunked loss, parallelisation and decoding. The on-disk format (DCP, the
architecture record, Hugging Face folders) is :mod:`attnlab.checkpoint`; the trainer registers the model with
torchtitan in ``attnlab/trainer/spec.py``."""

from __future__ import annotations

from attnlab.models.args import FLAVORS, ModelArgs, get_flavor  # noqa: F401
from attnlab.models.model import Transformer  # noqa: F401
