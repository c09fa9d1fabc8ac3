"""The tools users run, each ``python -m attnlab.tools.<tool>`` or ``attnlab <tool>`` (``attnlab.cli``), with
``--help`` for its arguments."""
