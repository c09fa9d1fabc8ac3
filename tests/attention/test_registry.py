"""One ``impl`` vocabulary: every mechanism accepts a subset of ``auto | reference | chunk | triton | fla``
(``attention.ops.common.IMPLS``), lists it in ``--list-attention``, and rejects anything else before training with
one message naming the key, the value and its own subset."""

import re

import pytest

from attnlab.attention import REGISTRY, build_attention, describe
from attnlab.attention.base import AttentionArgs
from attnlab.attention.ops.common import IMPLS


def test_impls_are_a_subset_of_the_vocabulary():
    for name, mech in REGISTRY.items():
        impls = mech.cls.impls
        assert "auto" in impls and set(impls) <= set(IMPLS), name
        assert list(impls) == [i for i in IMPLS if i in impls], name  # listed in the vocabulary's order


def test_other_spellings_fail_naming_key_value_and_subset():
    for name, mech in REGISTRY.items():
        for old in ("chunked", "recurrent", "sdpa", "serial", "flex", "fla_hopper"):
            args = AttentionArgs(dim=32, n_heads=4, n_kv_heads=2, head_dim=8, impl=old)
            msg = f"attention.impl={old!r} is not valid for {name}; choose from {list(mech.cls.impls)}"
            with pytest.raises(ValueError, match=re.escape(msg)):
                build_attention(name, args)


def test_list_attention_shows_each_subset():
    lines = describe().splitlines()
    for name, mech in REGISTRY.items():
        row = next(line for line in lines if line.split()[0] == name)
        assert " | ".join(mech.cls.impls) in row and mech.description in row
