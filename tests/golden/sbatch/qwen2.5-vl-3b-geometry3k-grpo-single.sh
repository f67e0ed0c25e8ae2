#!/bin/bash

# Parameters
#SBATCH --cpus-per-task=64
#SBATCH --error=/runs/JOB-20260101-000000/submitit/%j_0_log.err
#SBATCH --exclusive
#SBATCH --gpus-per-node=8
#SBATCH --job-name=qwen2.5-vl-3b-geometry3k-grpo
#SBATCH --mem=0
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --open-mode=append
#SBATCH --output=/runs/JOB-20260101-000000/submitit/%j_0_log.out
#SBATCH --partition=gpu
#SBATCH --requeue
#SBATCH --signal=USR2@300
#SBATCH --time=12:00:00
#SBATCH --wckey=submitit

# setup
# hpc-rl job qwen2.5-vl-3b-geometry3k-grpo: run dir /runs/JOB-20260101-000000
set -e
source envs/activate.sh
export PATH={ENV}/bin:"$PATH"
export VIRTUAL_ENV={ENV}
export PYTHONUNBUFFERED=1
export HPC_RL_RUN_DIR=/runs/JOB-20260101-000000
rm -f /runs/JOB-20260101-000000/rendezvous/*.json
export HPC_RL_NCCL_TIMEOUT_S=1800
export NCCL_DEBUG=WARN
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
if [ "${HPC_RL_DEBUG:-0}" = 1 ]; then echo "hpc-rl: $(hostname) job $SLURM_JOB_ID nodes $SLURM_JOB_NODELIST"; env | grep -E '^(NCCL|GLOO|TORCH_NCCL|HPC_RL)_' | sort; fi
set +e

# command
export SUBMITIT_EXECUTOR=slurm
srun --unbuffered --output /runs/JOB-20260101-000000/submitit/%j_%t_log.out --error /runs/JOB-20260101-000000/submitit/%j_%t_log.err --kill-on-bad-exit=1 {PYTHON} -u -m submitit.core._submit /runs/JOB-20260101-000000/submitit
