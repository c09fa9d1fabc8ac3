"""The README's "Adding a mechanism" from outside the package: a researcher's own module, in a folder of their own
(written here into a temporary folder, never imported by the package), registers a decayed linear attention with
its options dataclass through ``register_attention``; ``[experimental] custom_import`` imports it. It gets its
``[attention.tiny_linear]`` table and its row in the registry's listing, compiles with ``fullgraph=True`` and passes the
public conformance cell (``attnlab.testing.conformance.check_lifecycle``): two training processes from a meta build,
a checkpoint, a resume, the run rebuilt from its config.toml as the tools rebuild it, HF export and import,
decoding with its cache. Each test removes what it registered and imported.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import pytest

from attnlab import attention
from attnlab.attention.base import AttentionArgs
from attnlab.attention.registry import REGISTRY
from attnlab.config import DEFAULT_CONFIG, parse_config
from attnlab.testing.conformance import check_lifecycle
from attnlab.tools.launch import child_env

NAME = "tiny_linear"
MODULE = "mymech.tiny_linear"
"""``experimental.custom_import`` of the user's module: package ``mymech`` in the folder ``mymech_pkg``."""

SOURCE = textwrap.dedent('''
    """Decayed linear attention, a mechanism of the user's own package."""

    import math
    from dataclasses import dataclass

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torchtitan.models.utils import trunc_normal_

    from attnlab.attention import register_attention
    from attnlab.attention.base import AttentionArgs, AttentionContext
    from attnlab.attention.ops.common import check_impl
    from attnlab.attention.ops.linear_attn import gated_linear_attention


    @dataclass
    class TinyLinearOptions:
        decay: float = 0.9
        """Per-token decay γ of the state, in (0, 1]; 1 is plain linear attention."""


    @register_attention("tiny_linear", options=TinyLinearOptions, description="tiny decayed linear attention (a test)")
    class TinyLinearAttention(nn.Module):
        """h_t = γ h_{t-1} + φ(k_t) v_tᵀ, o_t = h_tᵀ φ(q_t), φ = elu + 1."""

        impls = ("auto", "reference", "chunk")
        """``[attention] impl`` values it accepts: the paths of ``gated_linear_attention`` that carry a decode
        state."""

        def __init__(self, args: AttentionArgs, opts: TinyLinearOptions):
            super().__init__()
            check_impl(args.impl, self.impls, self.mechanism)
            if not 0 < opts.decay <= 1:
                raise ValueError(f"attention.tiny_linear.decay={opts.decay} must be in (0, 1]")
            self.args, self.opts = args, opts
            self.n_heads, self.head_dim = args.n_heads, args.head_dim
            inner = args.n_heads * args.head_dim
            self.wq, self.wk, self.wv = (nn.Linear(args.dim, inner, bias=False) for _ in range(3))
            self.wo = nn.Linear(inner, args.dim, bias=False)

        def init_weights(self, init_std: float) -> None:
            for lin in (self.wq, self.wk, self.wv):
                trunc_normal_(lin.weight, mean=0.0, std=0.02)
            trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

        def init_cache(self, batch_size: int, max_len: int, device, dtype) -> dict:
            """The recurrent state [B, H, D, D] (fp32), all the decoding step needs."""
            return {"state": torch.zeros(batch_size, self.n_heads, self.head_dim, self.head_dim, device=device)}

        def flops_per_token(self, seq_len: int) -> int:
            # state readout and update, 2·D·D multiply-adds per head (the chunked form's intra-chunk terms left out)
            return 2 * 2 * self.n_heads * self.head_dim * self.head_dim

        def forward(self, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
            B, T, _ = x.shape
            q, k, v = (p(x).view(B, T, self.n_heads, self.head_dim) for p in (self.wq, self.wk, self.wv))
            q, k = F.elu(q) + 1, F.elu(k) + 1
            g = torch.full((B, T, self.n_heads), math.log(self.opts.decay), device=x.device)
            if ctx.cache is None:
                o, _ = gated_linear_attention(q, k, v, g, cu_seqlens=ctx.cu_seqlens, impl=self.args.impl)
            else:
                o, ctx.cache["state"] = gated_linear_attention(q, k, v, g, initial_state=ctx.cache["state"],
                                                               output_final_state=True, impl=self.args.impl)
            return self.wo(o.reshape(B, T, -1))
''')


@pytest.fixture
def user_folder(tmp_path):
    """The folder holding the user's package ``mymech`` (outside this repository), not on ``sys.path``; afterwards
    the mechanism is unregistered and the package forgotten, whoever imported it."""
    pkg = tmp_path / "mymech_pkg" / "mymech"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tiny_linear.py").write_text(SOURCE)
    yield pkg.parent
    REGISTRY.pop(NAME, None)
    for mod in [m for m in sys.modules if m == "mymech" or m.startswith("mymech.")]:
        del sys.modules[mod]


@pytest.fixture
def on_path(user_folder, monkeypatch):
    """:func:`user_folder`, on this process's ``sys.path`` for the test."""
    monkeypatch.syspath_prepend(str(user_folder))
    return user_folder


def _env_with(folder) -> dict[str, str]:
    """A child process's environment (``attnlab.tools.launch.child_env``) with ``folder`` on its PYTHONPATH."""
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(folder)])
    return env


def test_unknown_without_the_import(on_path):
    with pytest.raises(ValueError, match=f"model.attention='{NAME}' is not registered"):
        parse_config(["--job.config_file", DEFAULT_CONFIG, "--model.attention", NAME])
    assert NAME not in REGISTRY


def test_a_module_not_on_the_path_is_named(user_folder):
    with pytest.raises(ValueError, match=r"^experimental.custom_import='mymech.tiny_linear': importing it failed "
                                         r"\(ModuleNotFoundError: No module named 'mymech'\)"):
        parse_config(["--job.config_file", DEFAULT_CONFIG, "--experimental.custom_import", MODULE])


@pytest.mark.parametrize("spelling", ["flag", "flag=", "toml"])
def test_custom_import_gives_the_config_section(on_path, tmp_path, spelling):
    argv = ["--job.config_file", DEFAULT_CONFIG, "--experimental.custom_import", MODULE]
    if spelling == "flag=":
        argv = ["--job.config_file", DEFAULT_CONFIG, f"--experimental.custom_import={MODULE}"]
    elif spelling == "toml":
        toml = tmp_path / "mine.toml"
        toml.write_text(open(DEFAULT_CONFIG).read() + f'\n[experimental]\ncustom_import = "{MODULE}"\n')
        argv = ["--job.config_file", str(toml)]
    cfg = parse_config([*argv, "--model.attention", NAME, f"--attention.{NAME}.decay", "0.5"])
    assert cfg.experimental.custom_import == MODULE and cfg.attention.tiny_linear.decay == 0.5
    row = next(line for line in attention.describe().splitlines() if line.split()[0] == NAME)
    assert "auto | reference | chunk" in row and "tiny decayed linear attention" in row
    with pytest.raises(ValueError, match="attention.impl='triton' is not valid for tiny_linear"):
        attention.build_attention(NAME, AttentionArgs(dim=32, n_heads=2, n_kv_heads=2, head_dim=16, impl="triton"))


def test_compiles_with_fullgraph(on_path):
    from tests.attention.test_compile_fullgraph import _check

    importlib.import_module(MODULE)
    _check(NAME, "auto")


def test_conformance_cell_from_its_own_folder(user_folder, corpus, tmp_path):
    """The whole cell with the module imported only by ``experimental.custom_import``: in the training processes
    (the folder on their PYTHONPATH), and in this process when the run is rebuilt from its config.toml."""
    assert NAME not in REGISTRY and str(user_folder) not in sys.path
    check_lifecycle(NAME, tmp_path, corpus=corpus, train_flags=["--experimental.custom_import", MODULE],
                    pythonpath=[user_folder])


def test_a_bad_custom_import_is_one_line(user_folder):
    (user_folder / "mymech" / "broken.py").write_text("raise RuntimeError('the user module failed')\n")
    proc = subprocess.run([sys.executable, "-m", "attnlab.train", "--experimental.custom_import", "mymech.broken"],
                          env=_env_with(user_folder), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "train.py: error: experimental.custom_import='mymech.broken': importing it failed (RuntimeError: the user "
        "module failed); it must be a dotted module name importable from the Python path (PYTHONPATH)")


def test_list_attention_shows_the_imported_mechanism(user_folder):
    proc = subprocess.run([sys.executable, "-m", "attnlab.train", "--list-attention", "--experimental.custom_import",
                           MODULE], env=_env_with(user_folder), capture_output=True, text=True,
                          timeout=300, check=True)
    assert any(line.startswith(NAME + " ") for line in proc.stdout.splitlines()), proc.stdout


def test_an_export_read_elsewhere_imports_the_module_its_record_names(on_path, tmp_path):
    """The architecture record keeps ``experimental.custom_import``: a Hugging Face export of the mechanism, read in
    a process that never imported the user's package (only its folder on the path), imports it and loads."""
    from attnlab.checkpoint.dcp import build_model, model_args_from_config
    from attnlab.checkpoint.hf import save_hf
    from attnlab.checkpoint.load import load_checkpoint

    cfg = parse_config(["--job.config_file", DEFAULT_CONFIG, "--experimental.custom_import", MODULE,
                        "--model.attention", NAME, "--model.n_layers", "2"])
    model = build_model(model_args_from_config(cfg))
    save_hf(model.state_dict(), model.model_args, tmp_path / "hf")
    REGISTRY.pop(NAME)  # as in a fresh process: neither the mechanism nor its package imported
    for mod in [m for m in sys.modules if m == "mymech" or m.startswith("mymech.")]:
        del sys.modules[mod]
    fmt, args, sd = load_checkpoint(tmp_path / "hf")
    assert fmt == "hf" and args.custom_import == MODULE and NAME in REGISTRY
    assert [layer.attention.mechanism for layer in build_model(args, sd).layers.values()] == [NAME, NAME]
