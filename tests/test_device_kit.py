"""bench/device_kit.sh, the wheels a lent GPU machine needs: built here for this CPython, they install into a clean
folder with --no-index --no-deps, and hpc-rl, DeepSpeed, submitit and FastAPI import from that folder."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_the_device_kit_installs_offline_and_imports(tmp_path):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    kit, site = tmp_path / "kit", tmp_path / "site"
    built = subprocess.run(["bash", str(REPO / "bench" / "device_kit.sh"), "--python", version, "--out", str(kit)],
                           capture_output=True, text=True, timeout=600, cwd=REPO)
    assert built.returncode == 0, built.stdout + built.stderr
    assert "wheels," in built.stdout and "MiB" in built.stdout
    wheels = sorted(str(w) for w in kit.glob("*.whl"))
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                "--target", str(site), *wheels], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    # The kit's copies, not this env's, are the ones imported (the folder first on the path, as gpu_check.sh sets it).
    code = ("import sys, hpc_rl, deepspeed, submitit, fastapi, uvicorn, pydantic\n"
            "import hpc_rl.cli, hpc_rl.rollout.server.app, hpc_rl.train.engines, hpc_rl.cluster.submit\n"
            "mods = (hpc_rl, deepspeed, submitit, fastapi, uvicorn, pydantic)\n"
            "print([m.__name__ for m in mods if not m.__file__.startswith(sys.argv[1])])\n"
            "from deepspeed.git_version_info import installed_ops\n"
            "print(sorted(k for k, v in installed_ops.items() if v), 'fused_adam' in installed_ops)")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    ran = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, timeout=300,
                         env=env, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    outside, ops = ran.stdout.strip().splitlines()[-2:]
    assert outside == "[]"  # every module from the kit
    assert ops == "[] True"  # DeepSpeed built for CUDA with no op compiled ahead (they build JIT on the GPU machine)


def test_the_kit_check_names_what_neither_the_kit_nor_the_image_holds(tmp_path):
    """The check that ends device_kit.sh: a wheel needing a package that is in neither is one line naming it."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from _device_kit_check import check
    finally:
        sys.path.pop(0)
    import zipfile

    def wheel(name: str, version: str, requires: list[str]) -> None:
        with zipfile.ZipFile(tmp_path / f"{name}-{version}-py3-none-any.whl", "w") as z:
            meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
            z.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\n{meta}")

    wheel("a", "1.0", ["torch>=2.0", "b>=2", "numpy", "nowhere; python_version < '3.0'"])
    wheel("b", "1.5", ["torch==2.13.0", "missing-pkg", "docs-only; extra == 'docs'"])
    problems = check(tmp_path, "3.12", 32)
    assert problems == ["a-1.0-py3-none-any.whl: requires b>=2, the kit holds b 1.5",
                        "b-1.5-py3-none-any.whl: requires torch==2.13.0; the device's torch is another version",
                        "b-1.5-py3-none-any.whl: requires missing-pkg, which neither the kit nor the device image "
                        "holds; add it to bench/device_kit.sh's PINS"]
