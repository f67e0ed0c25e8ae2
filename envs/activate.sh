# Activate the hpc-rl env: `source envs/activate.sh [PREFIX]` (Slurm job preambles source this).
# PREFIX defaults to $HPC_RL_ENV, then the repo's .venv. Works for venvs and conda envs, with or
# without conda on PATH, and applies the env's hook (CUDA_HOME, env libraries first on LD_LIBRARY_PATH).
_hpc_rl_repo="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
_hpc_rl_env="${1:-${HPC_RL_ENV:-$_hpc_rl_repo/.venv}}"
if [ -d "$_hpc_rl_env/conda-meta" ]; then
    export CONDA_PREFIX="$_hpc_rl_env"
    export PATH="$_hpc_rl_env/bin:$PATH"
    for _hpc_rl_f in "$_hpc_rl_env"/etc/conda/activate.d/*.sh; do
        [ -f "$_hpc_rl_f" ] && . "$_hpc_rl_f"
    done
elif [ -f "$_hpc_rl_env/bin/activate" ]; then
    . "$_hpc_rl_env/bin/activate"
else
    echo "envs/activate.sh: no env at $_hpc_rl_env; run ./install.sh (or pass the env prefix)" >&2
    unset _hpc_rl_repo _hpc_rl_env
    return 1 2>/dev/null || exit 1
fi
unset _hpc_rl_repo _hpc_rl_env _hpc_rl_f
