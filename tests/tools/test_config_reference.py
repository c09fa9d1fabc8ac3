"""docs/configuration.md is what attnlab/tools/config_reference.py renders from the config dataclasses (no drift)."""

import dataclasses

from attnlab import config
from attnlab.attention.registry import REGISTRY
from attnlab.tools import config_reference


def test_configuration_page_is_current_and_complete():
    page = config_reference.render()
    assert config_reference.OUT.read_text() == page, "docs/configuration.md is stale: python -m attnlab.tools.config_reference"
    for cls in (config.Model, config.Data, config.Training):
        assert all(f"| `{f.name}` |" in page for f in dataclasses.fields(cls)), cls.__name__
    for name, mech in REGISTRY.items():
        assert f"### `[attention.{name}]`" in page
        assert all(f"| `{f.name}` |" in page for f in dataclasses.fields(mech.options)), name
