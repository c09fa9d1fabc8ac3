"""Attention mechanisms. Importing this package registers every mechanism (one import line each)."""

from attnlab.attention.registry import (REGISTRY, build_attention, describe, get_mechanism,  # noqa: F401
                                        register_attention)

# One line per mechanism module: importing it runs its @register_attention.
from attnlab.attention import softmax, parallax, gla, gated_linear, linear, deltanet, gdn, kda, hla, fox, path, cala, lla, affine  # noqa: F401,E401
