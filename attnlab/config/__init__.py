"""The configuration: the project's TOML sections (``sections``), merged into torchtitan 0.2.2's ``JobConfig``
(its custom-config mechanism) by ``parse``, and checked by ``checks``.

Precedence: command line (``--section.key value``) > TOML file > the defaults of ``sections`` and torchtitan's.
Sections added or extended here: ``[model]`` (attention choice), ``[training]`` (``stop_after_step``,
``nonfinite_skips``, ``loss_chunk_tokens``), ``[checkpoint]`` (``partial_load``), ``[attention]`` (one sub-table per
registered mechanism, e.g. ``[attention.parallax]``, generated from the registry), ``[data]``, and the
optimizer/scheduler fields of ``attnlab/optim/config.py``. :func:`parse_config` reads argv into the merged
``JobConfig``, first importing torchtitan's ``[experimental] custom_import`` module (a user's own mechanism or
optimizer); :func:`validate_config` checks every key's type (from the dataclass annotations) and the valid values
declared next to it (``field(metadata={"valid": RULE})``, :mod:`attnlab.config.rules`) once at start, naming the
key, the value and what is valid.
"""

from attnlab.config.checks import check_types, validate_config  # noqa: F401
from attnlab.config.parse import DEFAULT_CONFIG, names_config_file, parse_config  # noqa: F401
from attnlab.config.sections import Checkpoint, Data, Metrics, Model, Training, job_config_class  # noqa: F401
