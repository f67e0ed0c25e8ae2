#!/bin/bash

# Parameters
#SBATCH --array=0-7%4
#SBATCH --error=/runs/sweeps/sweep-kl-20260101-000000/submitit/%A_%a_0_log.err
#SBATCH --job-name=sweep-kl
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/runs/sweeps/sweep-kl-20260101-000000/submitit/%A_%a_0_log.out
#SBATCH --requeue
#SBATCH --signal=USR2@120
#SBATCH --time=00:30:00
#SBATCH --wckey=submitit

# setup
# hpc-rl job sweep-kl: run dir /runs/sweeps/sweep-kl-20260101-000000/arrays/1/"${SLURM_ARRAY_TASK_ID:-0}"
set -e
export PATH={ENV}/bin:"$PATH"
export VIRTUAL_ENV={ENV}
export PYTHONUNBUFFERED=1
export HPC_RL_RUN_DIR=/runs/sweeps/sweep-kl-20260101-000000/arrays/1/"${SLURM_ARRAY_TASK_ID:-0}"
rm -f /runs/sweeps/sweep-kl-20260101-000000/arrays/1/"${SLURM_ARRAY_TASK_ID:-0}"/rendezvous/*.json
export HPC_RL_NCCL_TIMEOUT_S=1800
export NCCL_DEBUG=WARN
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
if [ "${HPC_RL_DEBUG:-0}" = 1 ]; then echo "hpc-rl: $(hostname) job $SLURM_JOB_ID nodes $SLURM_JOB_NODELIST"; env | grep -E '^(NCCL|GLOO|TORCH_NCCL|HPC_RL)_' | sort; fi
set +e
export HPC_RL_RUN_DIR="$(cd "$HPC_RL_RUN_DIR" && pwd -P)"

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /runs/sweeps/sweep-kl-20260101-000000/submitit/%A_%a_%t_log.out --error /runs/sweeps/sweep-kl-20260101-000000/submitit/%A_%a_%t_log.err --kill-on-bad-exit=1 {PYTHON} -u -m submitit.core._submit /runs/sweeps/sweep-kl-20260101-000000/submitit
