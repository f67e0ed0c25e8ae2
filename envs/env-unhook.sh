# hpc-rl deactivation hook (conda etc/conda/deactivate.d/): restores what env-hook.sh changed.
if [ -n "${HPC_RL_SAVED_LD_LIBRARY_PATH+x}" ]; then
    if [ -n "$HPC_RL_SAVED_LD_LIBRARY_PATH" ]; then export LD_LIBRARY_PATH="$HPC_RL_SAVED_LD_LIBRARY_PATH"; else unset LD_LIBRARY_PATH; fi
    if [ -n "$HPC_RL_SAVED_CUDA_HOME" ]; then export CUDA_HOME="$HPC_RL_SAVED_CUDA_HOME"; else unset CUDA_HOME; fi
    unset HPC_RL_SAVED_LD_LIBRARY_PATH HPC_RL_SAVED_CUDA_HOME HPC_RL_ENV
fi
