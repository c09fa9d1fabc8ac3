"""The project's model, a Qwen3-style transformer whose attention block comes from the registry (``attention/``),
with its args and flavors, parallelisation, Hugging Face interop and decoding. The trainer registers it with
torchtitan in ``trainer/spec.py``."""

from __future__ import annotations

from models.args import FLAVORS, ModelArgs, get_flavor  # noqa: F401
from models.model import Transformer  # noqa: F401
