"""lm-eval-harness on our checkpoints (attnlab/tools/eval_downstream.py): a tiny local task offline, with lm-eval's
numbers checked against our model's own log-likelihoods."""

import json
import math

import pytest
import torch

from attnlab import attention
from attnlab.models.args import ModelArgs
from attnlab.checkpoint.dcp import build_model, save_dcp_state
from attnlab.checkpoint.layout import save_tokenizer
from tests.utils import make_corpus

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
from attnlab.tools import eval_downstream

TASKS = """
task: tiny_lambada
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' ' + text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def test_lm_eval_runs_a_run_folder_offline_and_agrees_with_our_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    corpus = make_corpus(tmp_path / "corpus")
    docs = [json.loads(line)["text"] for line in open(corpus["val"])][:6]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny.yaml").write_text(TASKS.format(data=data))
    # a run folder as the trainer leaves it: checkpoint/step-N and the run's tokenizer
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96, vocab_size=64,
                     max_seq_len=64, enable_weight_tying=True, attention="parallax",
                     attention_options={"parallax": attention.get_mechanism("parallax").options(rho_gate=True)})
    torch.manual_seed(0)
    model = build_model(args)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    save_dcp_state(model.state_dict(), run / "checkpoint" / "step-5", args)
    save_tokenizer(corpus["tokenizer"], run / "tokenizer")

    res = eval_downstream.main([str(run), "--tasks", "tiny_lambada", "--include-path", str(tmp_path / "tasks"),
                                "--device", "cpu", "--batch-size", "2", "-o", str(tmp_path / "out.json")])
    got = res["results"]["tiny_lambada"]
    assert json.loads((tmp_path / "out.json").read_text())["results"]["tiny_lambada"]["acc,none"] == got["acc,none"]

    # the same numbers from our model on each document as training tokenizes it (BOS first, the exported
    # tokenizer prepends it too): log p(last word | the words before), greedy-correct or not
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok = HuggingFaceTokenizer(str(run / "tokenizer"))
    lls, hits = [], []
    with torch.no_grad():
        for d in docs:
            ids = tok.encode(d, add_bos=True, add_eos=False)
            assert ids[0] == tok.bos_id
            logp = torch.log_softmax(model(torch.tensor([ids]))[0, :-1].double(), -1)
            lls.append(float(logp[-1, ids[-1]]))
            hits.append(int(logp[-1].argmax()) == ids[-1])
    assert got["perplexity,none"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-4)
    assert got["acc,none"] == pytest.approx(sum(hits) / len(hits))


def test_mechanisms_transformers_cannot_run_fail_clearly(tmp_path, capsys):
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96, vocab_size=64,
                     max_seq_len=64, attention="gdn", attention_options={"gdn": attention.get_mechanism("gdn").options()})
    save_dcp_state(build_model(args).state_dict(), tmp_path / "step-1", args)
    assert eval_downstream.main([str(tmp_path / "step-1"), "--tasks", "x"]) == 2
    assert "transformers cannot run" in capsys.readouterr().err


HUB_TASK = """
task: tiny_hub
dataset_path: attnlab-tests/no-such-dataset
output_type: loglikelihood
test_split: test
doc_to_text: "{{text}}"
doc_to_target: "{{text}}"
"""


def test_offline_a_task_that_needs_the_network_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    """Without a network lm-eval retried the Hub for about a minute, then printed a 40-line ConnectionError. Now the
    Hub is probed once, tasks load offline from local copies, and one that needs the Hub is named in one line, with
    how to run it from a local copy, before the checkpoint is exported or lm-eval evaluates anything."""
    import socket
    import time

    import datasets.config
    import lm_eval
    from huggingface_hub import constants

    def no_network(*a, **k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    calls = []
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kw: calls.append(kw))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub.yaml").write_text(HUB_TASK)
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=96, vocab_size=64,
                     max_seq_len=64, attention="softmax",
                     attention_options={"softmax": attention.get_mechanism("softmax").options()})
    save_dcp_state(build_model(args).state_dict(), tmp_path / "step-1", args)
    flags = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    start = time.monotonic()
    assert eval_downstream.main([str(tmp_path / "step-1"), "--tasks", "tiny_hub", "--include-path",
                                 str(tmp_path / "tasks")]) == 2
    assert time.monotonic() - start < 30  # lm-eval's own retries took about a minute
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "task tiny_hub needs the network" in err[0] and "attnlab-tests/no-such-dataset" in err[0]
    assert "HF_DATASETS_OFFLINE=1" in err[0] and "--include-path" in err[0]
    assert not calls  # nothing evaluated
    assert (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE) == flags  # offline mode only inside the tool
