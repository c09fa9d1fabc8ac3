#!/usr/bin/env bash
# Multi-node training under Slurm: one torchrun agent per node, meeting through torch's c10d rendezvous on the
# job's first node; torchrun starts one trainer (python -m attnlab.train) per GPU and FSDP2 shards over all of them.
#
#   sbatch --nodes=2 --gpus-per-node=8 scripts/slurm_train.sh --job.config_file attnlab/configs/paper/qwen3_1.7b_parallax.toml
#
# Arguments go to the trainer as they are. The run folder (job.dump_folder) and the data must be on a file system every
# node sees: each rank writes its own shards of every checkpoint there. Environment: GPUS_PER_NODE (default
# SLURM_GPUS_ON_NODE, else 8), RDZV_PORT (default 29500), PYTHON (default python3). docs/multinode.md has the
# plain torchrun commands this runs on each node.
#SBATCH --job-name=attnlab
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the header above, without the #SBATCH lines
    sed -n '2,/^#SBATCH/p' "${BASH_SOURCE[0]}" | grep -v '^#SBATCH' | sed 's/^# \{0,1\}//'
    exit 0
fi
for var in SLURM_JOB_NODELIST SLURM_NNODES SLURM_JOB_ID; do
    if [[ -z "${!var:-}" ]]; then
        echo "slurm_train.sh: error: $var is not set: run it with sbatch (or inside salloc), e.g." \
             "sbatch --nodes=2 --gpus-per-node=8 scripts/slurm_train.sh --job.config_file CONFIG; --help says more" >&2
        exit 2
    fi
done
cd "${SLURM_SUBMIT_DIR:-$(dirname "${BASH_SOURCE[0]}")/..}"
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
srun --kill-on-bad-exit=1 "${PYTHON:-python3}" -m torch.distributed.run \
    --nnodes="$SLURM_NNODES" --nproc_per_node="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}" \
    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$head_node:${RDZV_PORT:-29500}" \
    -m attnlab.train "$@"
