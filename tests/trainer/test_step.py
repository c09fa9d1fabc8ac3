"""The training step's host-side batch preparation (attnlab/trainer/step.py): the documents' offsets computed on the
host are the ones the model would compute itself, and the model gives the same logits with either."""

import pytest
import torch

from attnlab.attention.base import AttentionContext
from attnlab.models.args import ModelArgs
from attnlab.models.model import Transformer
from attnlab.trainer.step import batch_to_device


@pytest.mark.parametrize("rows,cu,longest", [
    ([[0, 1, 2, 3, 0, 1]], [0, 4, 6], 4),  # two documents in one row
    ([[0, 1, 0, 1], [2, 3, 4, 0]], [0, 2, 4, 7, 8], 3),  # a row starting inside a document starts a new one
    ([[5, 6, 7]], [0, 3], 3),  # no zero: the row is one document
    ([[0, 0, 0]], [0, 1, 2, 3], 1),  # one-token documents
])
def test_document_offsets(rows, cu, longest):
    got_cu, got_longest = AttentionContext.document_offsets(torch.tensor(rows))
    assert got_cu.dtype == torch.int32 and got_cu.tolist() == cu and got_longest == longest


def test_the_models_logits_are_the_same_with_offsets_from_the_host():
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=64, vocab_size=50,
                     attn_mask_type="block_causal")
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    tokens = torch.randint(0, 50, (2, 12))
    positions = torch.tensor([list(range(5)) + list(range(7)), [3, 4, 5] + list(range(9))])
    batch, labels = batch_to_device({"input": tokens, "positions": positions}, tokens, torch.device("cpu"), True)
    cu, longest = batch["documents"]
    assert cu.tolist() == [0, 5, 12, 15, 24] and longest == 9
    assert torch.equal(labels, tokens) and torch.equal(batch["positions"], positions)
    expect = model(tokens, positions)
    torch.testing.assert_close(model(tokens, positions, documents=batch["documents"]), expect, rtol=0, atol=0)
    one_document = (torch.tensor([0, 24], dtype=torch.int32), 24)  # the model takes what it is given
    assert not torch.allclose(model(tokens, positions, documents=one_document), expect)
    # without documents (a causal run, or context parallelism) nothing is added
    assert "documents" not in batch_to_device({"input": tokens, "positions": positions}, tokens,
                                              torch.device("cpu"), False)[0]
