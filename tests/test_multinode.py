"""Beyond one machine: ``scripts/slurm_train.sh`` under a stand-in ``srun`` (one task per node) and ``scontrol``
starts two torchrun "nodes" of one process each on localhost; they meet through the c10d rendezvous (as two hosts
do, with the same --rdzv_endpoint; docs/multinode.md) and train on a shared run folder, and the run resumes on one
node with the losses the two-node run had."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.utils import REPO, free_port, losses, make_corpus, read_metrics, run_train, tiny_args


@pytest.mark.slow  # CI time: 20-30 s on 2 cores
def test_two_nodes_through_c10d_rendezvous_then_resume_on_one(tmp_path):
    corpus = make_corpus(tmp_path / "corpus")
    dump = tmp_path / "run"
    flags = tiny_args(corpus, dump, 4, 16, 2, "--training.global_batch_size", "4", "--checkpoint.interval", "2",
                      "--validation.freq", "2")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")  # show hostnames: the head node
    (bin_dir / "srun").write_text(textwrap.dedent("""\
        #!/usr/bin/env bash
        # srun --ntasks-per-node=1 on SLURM_NNODES nodes: the command once per node, side by side
        while [[ $1 == -* ]]; do shift; done
        pids=()
        for n in $(seq 0 $((SLURM_NNODES - 1))); do
            SLURM_NODEID=$n "$@" > "$SRUN_LOGS/node$n.log" 2>&1 & pids+=($!)
        done
        rc=0; for p in "${pids[@]}"; do wait "$p" || rc=1; done; exit $rc
        """))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "PYTHON": sys.executable, "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "7",
           "SLURM_SUBMIT_DIR": str(REPO), "GPUS_PER_NODE": "1", "RDZV_PORT": str(free_port()),
           "SRUN_LOGS": str(tmp_path)}
    env.pop("LOCAL_RANK", None)
    job = subprocess.run(["bash", str(REPO / "scripts" / "slurm_train.sh"), *flags], env=env, timeout=300)
    logs = [(tmp_path / f"node{n}.log").read_text() for n in range(2)]
    assert job.returncode == 0, "\n\n".join(log[-3000:] for log in logs)
    two_nodes = losses(dump)
    assert sorted(two_nodes) == [1, 2, 3, 4]

    # the step-2 checkpoint, written by both nodes, resumed on one node (the data loader reshards 2 -> 1)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    os.rename(dump / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    log = run_train([*flags[:3], str(resumed), *flags[4:]])
    assert "resharded from 2 to 1 ranks" in log.stdout + log.stderr
    one_node = losses(resumed)
    assert sorted(one_node) == [3, 4], one_node
    for s in (3, 4):
        assert abs(one_node[s] - two_nodes[s]) <= 1e-4, (s, one_node[s], two_nodes[s])
    assert [r["step"] for r in read_metrics(resumed) if "val_loss" in r] == [4]


@pytest.mark.slow  # 4 processes; HSDP 2 x 2 also runs on GPUs (attnlab/tools/multigpu_check.py --replicate 2)
def test_hsdp_two_replicas_of_two_shards_then_resume_on_plain_fsdp(tmp_path):
    """HSDP (the layout for several nodes: replicas across nodes, FSDP shards within one) on 4 gloo processes, its
    step-2 checkpoint resumed on 2 processes of plain FSDP: DCP reshards from the 2 x 2 mesh, and the losses of
    steps 3-4 are the HSDP run's."""
    corpus = make_corpus(tmp_path / "corpus")
    dump = tmp_path / "hsdp"
    flags = tiny_args(corpus, dump, 4, 16, 1, "--training.global_batch_size", "4", "--checkpoint.interval", "2",
                      "--validation.no-enable", "--model.attention", "gdn", "--optimizer.name", "muon",
                      "--optimizer.muon_ns_dtype", "float32")
    hsdp = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
    run_train(flags + hsdp, nproc=4)
    four = losses(dump)
    assert sorted(four) == [1, 2, 3, 4]
    resumed = tmp_path / "fsdp"
    (resumed / "checkpoint").mkdir(parents=True)
    os.rename(dump / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    run_train([*flags[:3], str(resumed), *flags[4:]], nproc=2)
    two = losses(resumed)
    assert sorted(two) == [3, 4], two
    for s in (3, 4):
        assert abs(two[s] - four[s]) <= 1e-4, (s, two[s], four[s])
