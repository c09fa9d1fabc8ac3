"""The on-disk format: run, step and Hugging Face folders (``layout``), DCP checkpoints with the ``attnlab.json``
architecture record (``dcp``), the Hugging Face adapter and remote code (``hf``, ``hf_remote``), the one loader
every tool uses (``load``), and the Transformer→Parallax weight conversion (``convert``)."""
