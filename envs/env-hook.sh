# hpc-rl activation hook, installed into the env by install.sh (venv: sourced from bin/activate;
# conda: etc/conda/activate.d/). It puts the env's own CUDA/cuDNN/NCCL libraries first on
# LD_LIBRARY_PATH and sets CUDA_HOME to the env's toolkit, so a system CUDA (module load cuda,
# /usr/local/cuda) cannot be loaded by mistake. Safe to source more than once.
_hpc_rl_prefix="@PREFIX@"
if [ -z "${HPC_RL_SAVED_LD_LIBRARY_PATH+x}" ]; then
    export HPC_RL_SAVED_LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}"
    export HPC_RL_SAVED_CUDA_HOME="${CUDA_HOME:-}"
fi
_hpc_rl_libs=""
# conda envs: the CUDA runtime, cuDNN and NCCL from conda-forge live in PREFIX/lib.
if [ -d "$_hpc_rl_prefix/conda-meta" ] && [ -d "$_hpc_rl_prefix/lib" ]; then
    _hpc_rl_libs="$_hpc_rl_prefix/lib"
fi
# venvs (and pip layers of conda envs): the nvidia-* wheels torch depends on.
for _hpc_rl_d in "$_hpc_rl_prefix"/lib/python3*/site-packages/nvidia/*/lib \
                 "$_hpc_rl_prefix"/lib/python3*/site-packages/nvidia/cu1*/lib; do
    [ -d "$_hpc_rl_d" ] || continue
    case ":$_hpc_rl_libs:" in *":$_hpc_rl_d:"*) ;; *) _hpc_rl_libs="${_hpc_rl_libs:+$_hpc_rl_libs:}$_hpc_rl_d" ;; esac
done
if [ -n "$_hpc_rl_libs" ]; then
    export LD_LIBRARY_PATH="$_hpc_rl_libs${HPC_RL_SAVED_LD_LIBRARY_PATH:+:$HPC_RL_SAVED_LD_LIBRARY_PATH}"
fi
# CUDA_HOME: the env's own toolkit (nvcc for DeepSpeed's JIT ops) when it has one.
for _hpc_rl_d in "$_hpc_rl_prefix" "$_hpc_rl_prefix"/lib/python3*/site-packages/nvidia/cuda_nvcc \
                 "$_hpc_rl_prefix"/lib/python3*/site-packages/nvidia/cu1*; do
    if [ -x "$_hpc_rl_d/bin/nvcc" ]; then
        export CUDA_HOME="$_hpc_rl_d"
        break
    fi
done
export HPC_RL_ENV="$_hpc_rl_prefix"
unset _hpc_rl_prefix _hpc_rl_libs _hpc_rl_d
