"""attnlab: pretrain a Qwen3-style LLM on torchtitan and swap its attention block with one TOML key.

The package's layers, bottom to top (docs/architecture.md): ``attention`` (mechanisms and their ``ops``),
``models`` (the model), ``checkpoint`` (the on-disk format), ``optim``, ``data``, ``config``, ``trainer``, the
entry point ``attnlab.train`` (``python -m attnlab.train``), the ``tools`` users run (``attnlab <tool>``), the
shipped ``configs`` and ``testing`` (helpers for a mechanism's own tests). Importing ``attnlab`` imports none of
them, so ``import attnlab`` stays cheap.
"""

