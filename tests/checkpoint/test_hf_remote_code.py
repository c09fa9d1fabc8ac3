"""Exports of Parallax and softmax-with-options load in transformers through the remote-code model
(``trust_remote_code=True``) with the same logits as ours (float32)."""

import ast
import json
import warnings

import pytest
import torch

from attnlab.checkpoint.hf import REMOTE_CODE_DIR, save_hf
from tests.checkpoint.test_hf import _args, _model

transformers = pytest.importorskip("transformers")
warnings.filterwarnings("ignore", message=".*torch_dtype.*")


@pytest.mark.parametrize("pattern,opts,tied", [
    (["parallax"] * 2, {}, True),
    (["parallax"] * 2, {"parallax": {"rho_gate": True, "rope_on_rho": False, "rho_gate_bias": 1.0}}, False),
    (["parallax", "softmax", "parallax"], {"parallax": {"rho_gate": True}, "softmax": {"qk_norm": False}}, True),
    (["softmax"] * 2, {"softmax": {"window_size": 4}}, False),
    (["parallax"] * 2, {"parallax": {"window_size": 5}}, True),
])
def test_remote_code_logits_match(tmp_path, pattern, opts, tied):
    args = _args(pattern, tied=tied, **opts)
    model = _model(args, seed=2)
    save_hf(model.state_dict(), args, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_attnlab.AttnLabForCausalLM"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True,
                                                           dtype=torch.float32).eval()
    assert type(hf).__name__ == "AttnLabForCausalLM"
    x = torch.randint(0, 67, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(hf(x).logits, ref, rtol=1e-5, atol=1e-5)
        # left padding with an attention mask gives each row its unpadded logits
        padded = torch.cat([torch.zeros(2, 3, dtype=x.dtype), x], 1)
        mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones_like(x)], 1)
        torch.testing.assert_close(hf(padded, attention_mask=mask).logits[:, 3:], ref, rtol=1e-5, atol=1e-5)
        out = hf.generate(x[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)


def test_remote_code_is_standalone():
    """The modeling files import only torch and transformers (and each other), never this project."""
    for path in REMOTE_CODE_DIR.glob("*_attnlab.py"):
        tree = ast.parse(path.read_text())
        roots = {(n.module or "").split(".")[0] if isinstance(n, ast.ImportFrom) and not n.level else "."
                 for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        roots |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert roots <= {"__future__", "torch", "transformers", "."}, (path.name, roots)


def test_other_mechanisms_keep_refusing(tmp_path):
    args = _args(["softmax", "gdn"])
    save_hf(_model(args).state_dict(), args, tmp_path / "hf")
    assert "auto_map" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    assert not (tmp_path / "hf" / "modeling_attnlab.py").exists()
