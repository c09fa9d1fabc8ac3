"""docs/configuration.md is what scripts/config_reference.py renders from the config dataclasses (no drift)."""

import dataclasses

import pytest

import config
from attention.registry import REGISTRY
from scripts import config_reference


def test_configuration_page_is_current():
    assert config_reference.OUT.read_text() == config_reference.render(), (
        "docs/configuration.md is stale: run python -m scripts.config_reference")


def test_page_lists_every_project_key():
    page = config_reference.render()
    for cls in (config.Model, config.Data, config.Training):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in page, f.name
    for name, mech in REGISTRY.items():
        assert f"### `[attention.{name}]`" in page
        for f in dataclasses.fields(mech.options):
            assert f"| `{f.name}` |" in page, (name, f.name)


def test_help_writes_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        config_reference.main(["--help", "--out", str(tmp_path / "c.md")])
    assert not (tmp_path / "c.md").exists()
