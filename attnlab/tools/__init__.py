"""The tools users run, each ``python -m attnlab.tools.<tool>`` or ``attnlab <tool>`` (``attnlab.cli``), with
``--help`` for its arguments; ``common`` holds the command line they share (``CKPT``, ``--step``, train.py flags)."""
