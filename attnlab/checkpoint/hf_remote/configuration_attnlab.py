"""Configuration of attnlab's exported models (``model_type = "attnlab"``).

The architecture lives under ``config.attnlab`` exactly as the exporting framework records it: ``dim``,
``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``hidden_dim``, ``vocab_size``, ``norm_eps``,
``rope_theta``, ``enable_weight_tying``, ``layer_pattern`` (one mechanism per layer) and
``attention_options`` (per mechanism). The Qwen3-named fields next to it are for tools that read them.
"""

from transformers import PretrainedConfig


class AttnLabConfig(PretrainedConfig):
    model_type = "attnlab"

    def __init__(self, attnlab: dict | None = None, tie_word_embeddings: bool = False, **kwargs):
        self.attnlab = attnlab or {}
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
