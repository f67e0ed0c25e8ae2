#!/bin/bash

#SBATCH --job-name=qwen2.5-vl-3b-geometry3k-grpo
#SBATCH --signal=B:USR2@300
#SBATCH --requeue
#SBATCH --output=/runs/JOB-20260101-000000/submitit/%j_batch.out
#SBATCH --error=/runs/JOB-20260101-000000/submitit/%j_batch.err
#SBATCH --open-mode=append
#SBATCH --partition=gpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=12:00:00
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH hetjob
#SBATCH --partition=gpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --time=12:00:00
#SBATCH --cpus-per-task=64
#SBATCH --gpus-per-node=8
#SBATCH --mem=0
#SBATCH --exclusive

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
# Preemption / time limit (--signal=B:USR2 reaches this shell only): srun passes USR2 on to the trainer
# component, whose ranks checkpoint at their next step boundary and exit; then the whole job is requeued
# and the run resumes from that checkpoint.
preempt() {
  echo "hpc-rl: caught USR2; the trainer ranks checkpoint, then job $SLURM_JOB_ID is requeued"
  kill -USR2 "$trainer_srun" 2>/dev/null
  for _ in $(seq 295); do kill -0 "$trainer_srun" 2>/dev/null || break; sleep 1; done
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}
trap preempt USR2

srun --het-group=0 --unbuffered --kill-on-bad-exit=1 --ntasks-per-node=1 --output /runs/JOB-20260101-000000/submitit/"$SLURM_JOB_ID"_trainer_%t_log.out --error /runs/JOB-20260101-000000/submitit/"$SLURM_JOB_ID"_trainer_%t_log.err \
  {PYTHON} -u -m hpc_rl.cluster.task /runs/JOB-20260101-000000 --node-offset 0 --num-nodes 2 &
trainer_srun=$!
srun --het-group=1 --unbuffered --kill-on-bad-exit=1 --ntasks-per-node=1 --output /runs/JOB-20260101-000000/submitit/"$SLURM_JOB_ID"_rollout_%t_log.out --error /runs/JOB-20260101-000000/submitit/"$SLURM_JOB_ID"_rollout_%t_log.err \
  {PYTHON} -u -m hpc_rl.cluster.task /runs/JOB-20260101-000000 --node-offset 1 --num-nodes 2 &
rollout_srun=$!

# Wait for both components; `wait` returns early on the trap, so loop until no child is left.
rc=0
for pid in $(jobs -p); do wait "$pid" || rc=$?; done
exit $rc
