"""Every TOML in configs/ parses, validates and builds its model on the meta device."""

import pytest
import torch

from attnlab.trainer.spec import register_train_spec
from attnlab.models.args import get_flavor
from attnlab.models.model import Transformer
from attnlab.config import parse_config
from tests.utils import REPO

CONFIGS = sorted((REPO / "attnlab" / "configs").rglob("*.toml"))
PAPER = REPO / "attnlab" / "configs" / "paper"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_builds_on_meta(path):
    register_train_spec()
    cfg = parse_config(["--job.config_file", str(path)])
    args = get_flavor(cfg.model.flavor)
    args.update_from_config(cfg)
    with torch.device("meta"):
        model = Transformer(args)
    nparams, flops = args.get_nparams_and_flops(model, cfg.training.seq_len)
    assert nparams > 0 and flops > 6 * (nparams - model.tok_embeddings.weight.numel())


def test_generated_configs_are_current(tmp_path):
    """attnlab/configs/paper/ holds exactly what attnlab/tools/make_configs.py writes (no hand edits drift)."""
    import attnlab.tools.make_configs as mk

    mk.main(["--out", str(tmp_path)])
    written = sorted(tmp_path.iterdir())
    assert written
    for f in written:
        assert f.read_text() == (PAPER / f.name).read_text(), f.name


def test_make_configs_help_writes_nothing(tmp_path, capsys):
    import attnlab.tools.make_configs as mk

    with pytest.raises(SystemExit):
        mk.main(["--help", "--out", str(tmp_path)])
    assert "--out" in capsys.readouterr().out and not list(tmp_path.iterdir())


def test_paper_values():
    cfg = parse_config(["--job.config_file", str(PAPER / "qwen3_0.6b_parallax.toml")])
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.optimizer.weight_decay) == ("muon", 5e-3, 0.1)
    assert (cfg.lr_scheduler.schedule, cfg.lr_scheduler.warmup_steps, cfg.lr_scheduler.decay_start) == ("wsd", 0, 0.8)
    assert cfg.training.global_batch_size * cfg.training.seq_len == 3_932_160 and cfg.training.max_norm == 1.0
    assert cfg.attention.parallax.rope_on_rho and cfg.model.converters == ["quantize.linear.float8"]
    cos = parse_config(["--job.config_file", str(PAPER / "qwen3_1.7b_softmax_adamw_cosine.toml")])
    assert (cos.optimizer.name, cos.optimizer.lr, cos.lr_scheduler.warmup_fraction) == ("AdamW", 3e-4, 0.01)
    assert cos.training.global_batch_size == 1920


@pytest.mark.parametrize("path", sorted(PAPER.glob("*.toml")), ids=lambda p: p.stem)
def test_paper_parallax_configs_use_the_papers_gain(path):
    """Every paper config that builds Parallax layers sets ρ's RMSNorm gain to the paper's 1.0 (its recipe as
    written), not the framework default."""
    cfg = parse_config(["--job.config_file", str(path)])
    if "parallax" in [cfg.model.attention, *cfg.model.layer_pattern]:
        assert cfg.attention.parallax.rho_norm_init == 1.0
