"""The end of a two-process run: no process group's worker thread is left for the interpreter's finalisation
(attnlab/trainer/teardown.py). Each training process runs this file as ``__main__``: train.py's ``main``, then a look at
its own threads."""

import os
import runpy
import sys

from tests.utils import run_train, tiny_args

# the threads of a gloo process group: its work queue's runners and its transport's event loop
GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def threads() -> list[str]:
    """The names of this process's threads (Linux)."""
    task = "/proc/self/task"
    return [open(f"{task}/{t}/comm").read().strip() for t in os.listdir(task)]


def test_no_process_group_thread_outlives_a_context_parallel_run(corpus, tmp_path):
    """CP = 2 over 2 processes: FSDP's DTensors (whose sharding caches keep the meshes), the CP group, checkpoints
    and validation, all of which use the groups."""
    run_train(tiny_args(corpus, tmp_path, 2, 16, 2, "--model.attn_mask_type", "block_causal",
                        "--parallelism.context_parallel_degree", "2", "--checkpoint.interval", "2",
                        "--validation.freq", "2"), nproc=2, module=__name__)


if __name__ == "__main__":  # a training process of the test above
    from tests.utils import REPO

    sys.argv[0] = str(REPO / "train.py")
    runpy.run_path(sys.argv[0], run_name="__main__")
    left = [t for t in threads() if t in GLOO_THREADS]
    if left:
        sys.exit(f"process group threads alive after train.py: {left}")
