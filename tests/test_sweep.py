"""Sweeps without a cluster: sweep file -> points, errors naming the cause, the array script (its
per-element run dir evaluated by bash), `sweep status` from a sweep dir's own files.

Also home of `flaky_reward`, the planted fault of tests/test_sweep_slurm.py (the job's nodes import it
as tests.test_sweep:flaky_reward from the repo root)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rl import config
from hpc_rl.cluster import sweep as sw
from hpc_rl.cluster.sweep_status import point_infos
from hpc_rl.errors import ConfigError
from hpc_rl.rewards.toy import repeat_digit

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "jobs" / "toy-grpo-cpu.yaml"
_calls = 0


def flaky_reward(prompt: str, completion: str, ground_truth: str, **kw) -> float:
    """The toy reward, except that it raises after N samples when the run dir holds FAIL_AFTER (= N)."""
    global _calls
    _calls += 1
    marker = Path(os.environ.get("HPC_RL_RUN_DIR", "/nonexistent")) / "FAIL_AFTER"
    if marker.is_file() and _calls > int(marker.read_text()):
        raise RuntimeError(f"planted fault after {_calls - 1} samples")
    return repeat_digit(prompt, completion, ground_truth)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "sweep.yaml"
    p.write_text(text)
    return p


def test_grid_list_and_seeds_expand_in_order(tmp_path):
    spec = sw.load_sweep(_write(tmp_path, f"""
base: {TOY}
overrides: [trainer.steps=3]
grid: {{algorithm.kl.coef: [0.0, 0.1], trainer.lr: [1.0e-3, 3.0e-3]}}
list: [{{algorithm.name: rloo}}]
seeds: [1, 2]
max_parallel: 3
"""))
    assert spec.name == "sweep" and spec.max_parallel == 3 and spec.overrides == ["trainer.steps=3"]
    ov = [p.overrides for p in spec.points]
    assert len(ov) == 10 and [p.index for p in spec.points] == list(range(10))
    assert ov[0] == {"algorithm.kl.coef": 0.0, "trainer.lr": 1e-3, "seed": 1}
    assert ov[1] == {"algorithm.kl.coef": 0.0, "trainer.lr": 1e-3, "seed": 2}
    assert ov[7] == {"algorithm.kl.coef": 0.1, "trainer.lr": 3e-3, "seed": 2}
    assert ov[8:] == [{"algorithm.name": "rloo", "seed": 1}, {"algorithm.name": "rloo", "seed": 2}]
    assert spec.points[7].label == "kl.coef=0.1 trainer.lr=0.003 seed=2"
    # The override text parses back to the same values in the job spec.
    cfg = sw.point_config(spec, spec.points[7])
    assert (cfg.algorithm.kl.coef, cfg.trainer.lr, cfg.seed, cfg.trainer.steps) == (0.1, 3e-3, 2, 3)
    assert sw.point_config(spec, spec.points[9]).algorithm.name == "rloo"


def test_no_grid_no_seeds_is_one_point_and_base_is_relative_to_the_file(tmp_path):
    (tmp_path / "base.yaml").write_text(TOY.read_text())
    spec = sw.load_sweep(_write(tmp_path, "name: one\nbase: base.yaml\n"))
    assert [p.overrides for p in spec.points] == [{}] and spec.points[0].label == "base"
    assert spec.base == tmp_path / "base.yaml"


@pytest.mark.parametrize("text, needle", [
    ("base: {toy}\ngird: {{a: [1]}}\n", "unknown key(s) gird"),
    ("grid: {{algorithm.kl.coef: [0.1]}}\n", "base is missing"),
    ("base: nope.yaml\n", "base 'nope.yaml' not found"),
    ("base: {toy}\nseeds: 3\n", "seeds must be a non-empty list"),
    ("base: {toy}\nmax_parallel: 0\n", "max_parallel must be an integer >= 1"),
    ("base: {toy}\ngrid: {{algorithm.kl.coef: 0.1}}\n", "grid.algorithm.kl.coef must be a non-empty list"),
    ("base: {toy}\ngrid: {{algorithm.kl.coef: [0.1, -1]}}\n", "sweep point 1 (kl.coef=-1): algorithm.kl.coef"),
    ("base: {toy}\ngrid: [1]\n", "grid must map dotted keys to lists of values, e.g. grid: {algorithm"),
    ("base: {toy}\nlist: [1]\n", "list must be a list of mappings of dotted overrides, e.g. list: [{trainer"),
    ("base: {toy}\nlist: [{{trainer.lrr: 1}}]\n", "sweep point 0 (trainer.lrr=1): trainer.lrr: unknown key"),
])
def test_sweep_file_errors_name_the_cause(tmp_path, text, needle):
    with pytest.raises(ConfigError) as e:
        sw.load_sweep(_write(tmp_path, text.format(toy=TOY)))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_points_needing_different_slurm_resources_cannot_share_an_array(tmp_path):
    cfgs = [config.load(TOY, ["trainer.nodes=1"]), config.load(TOY, ["trainer.nodes=2"])]
    with pytest.raises(ConfigError, match=r"sweep points 0 and 1 need different Slurm settings \(nodes\)"):
        sw.array_params(cfgs, tmp_path / "arrays" / "1", "s", 2)
    # Names and seeds differ per point but not the array's settings.
    same = [config.load(TOY, ["name=a", "seed=1"]), config.load(TOY, ["name=b", "seed=2"])]
    params = sw.array_params(same, tmp_path / "arrays" / "1", "s", 2)
    assert params["job_name"] == "s" and params["array_parallelism"] == 2 and params["nodes"] == 2


@pytest.mark.parametrize("dirname", ["plain", "with space's"])
def test_array_preamble_gives_each_element_its_own_run_dir(tmp_path, dirname):
    """Run the rendered preamble's run-dir lines in bash for array task 1: HPC_RL_RUN_DIR is that
    point's real run dir and its rendezvous files (only its) are cleared."""
    root = tmp_path / dirname
    slot = root / "arrays" / "1"
    slot.mkdir(parents=True)
    points = []
    for i in range(2):
        d = root / "points" / f"0{i}-p"
        (d / "rendezvous").mkdir(parents=True)
        (d / "rendezvous" / "master.json").write_text("{}")
        (slot / str(i)).symlink_to(os.path.relpath(d, slot))
        points.append(d)
    cfg = config.load(TOY)
    script = sw.render_array([cfg, cfg], root, "s", 1)
    assert "#SBATCH --array=0-1%1" in script and "#SBATCH --job-name=s" in script
    lines = [ln for ln in script.splitlines() if "HPC_RL_RUN_DIR" in ln or ln.startswith("rm -f")]
    assert len(lines) == 3, lines
    p = subprocess.run(["bash", "-c", "\n".join(lines) + '\necho "$HPC_RL_RUN_DIR"'], capture_output=True,
                       text=True, env={**os.environ, "SLURM_ARRAY_TASK_ID": "1"})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(points[1].resolve())
    assert not (points[1] / "rendezvous" / "master.json").exists()
    assert (points[0] / "rendezvous" / "master.json").exists()


def test_dry_run_lists_points_and_the_array_script(tmp_path):
    p = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "sweep", str(REPO / "jobs" / "sweep-kl.yaml"),
                        "--dry-run"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "# sweep sweep-kl: 8 point(s)" in p.stdout and "#SBATCH --array=0-7%4" in p.stdout
    assert "#     7  algorithm.kl.coef=0.2 seed=2" in p.stdout
    assert "nothing submitted" in p.stdout and not (tmp_path / "runs").exists()


def _fake_point(root: Path, index: int, label: str, overrides: dict, job_id: str, result, rewards, kls,
                trainer_log: str = "") -> dict:
    run = root / "points" / f"{index:02d}-x"
    (run / "submitit").mkdir(parents=True)
    (run / "logs").mkdir()
    (run / "job.yaml").write_text(config.dump(config.load(TOY, ["trainer.steps=4"])))
    (run / "slurm.json").write_text(json.dumps({"job_id": job_id, "trainer_nodes": 1}))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s + 1, "reward_mean": r, "kl": k}) + "\n"
                                               for s, (r, k) in enumerate(zip(rewards, kls))))
    if result is not None:
        with open(run / "submitit" / f"{job_id}_0_result.pkl", "wb") as f:
            pickle.dump(result, f)
    (run / "submitit" / f"{job_id}_0_log.err").write_text("srun: error: task 0 exited\nClusterError: node 0 exited\n")
    (run / "logs" / "trainer-0.log").write_text(trainer_log)
    return {"index": index, "overrides": overrides, "label": label, "run_dir": str(run), "job_ids": [job_id]}


def test_status_from_files_shows_states_rewards_and_failed_log_tail(tmp_path):
    root = tmp_path / "kl-20260101-000000"
    root.mkdir()
    pts = [_fake_point(root, 0, "kl.coef=0.0 seed=1", {"algorithm.kl.coef": 0.0, "seed": 1}, "999990_0",
                       ("success", 0), [0.1, 0.5, 0.4, 0.45], [0.0, 0.01, 0.02, 0.03]),
           _fake_point(root, 1, "kl.coef=0.1 seed=1", {"algorithm.kl.coef": 0.1, "seed": 1}, "999990_1",
                       ("error", "Traceback ..."), [0.1, 0.2], [0.0, 0.002],
                       trainer_log="step 2/4\nerror: reward.function raised RuntimeError: boom\n")]
    (root / "sweep.json").write_text(json.dumps({"name": "kl", "points": pts,
                                                 "submissions": [{"array_job_id": "999990"}]}))
    # Point 0 evaluated at steps 0, 2, 4 (and once offline, which the table leaves to `hpc-rl eval`'s output).
    (root / "points" / "00-x" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "source": "train", "eval/pass@1": 0.05}, {"step": 2, "source": "train", "eval/pass@1": 0.6},
        {"step": 4, "source": "offline", "eval/pass@1": 0.9}, {"step": 4, "source": "train", "eval/pass@1": 0.55}]))
    infos = point_infos(root)
    assert [(i["state"], i["step"], i["steps"]) for i in infos] == [("COMPLETED", 4, 4), ("FAILED", 2, 4)]
    assert (infos[0]["reward_last"], infos[0]["reward_best"], infos[0]["kl"]) == (0.45, 0.5, 0.03)
    assert (infos[0]["eval_pass1_last"], infos[0]["eval_pass1_best"]) == (0.55, 0.6)
    assert (infos[1]["eval_pass1_last"], infos[1]["eval_pass1_best"]) == (None, None)
    assert infos[0]["log_tail"] == []
    assert "trainer-0.log: error: reward.function raised RuntimeError: boom" in infos[1]["log_tail"]
    assert "999990_1_0_log.err: ClusterError: node 0 exited" in infos[1]["log_tail"]

    p = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "sweep", "status", "kl", "--sweeps-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[1].split() == ["IDX", "OVERRIDES", "STATE", "JOB", "STEP", "REWARD", "BEST", "KL", "EVAL", "P@1",
                                "BEST", "P@1", "RUN", "DIR"]
    assert lines[2].split() == ["0", "kl.coef=0.0", "seed=1", "COMPLETED", "999990_0", "4/4", "0.450", "0.500",
                                "0.0300", "0.550", "0.600", "points/00-x"]
    assert lines[3].split()[-3:-1] == ["-", "-"]
    assert "FAILED" in lines[3] and "point 1 (kl.coef=0.1 seed=1) FAILED; last log lines:" in p.stdout
    j = json.loads(subprocess.run([sys.executable, "-m", "hpc_rl.cli", "sweep", "status", str(root), "--json"],
                                  capture_output=True, text=True, timeout=120).stdout)
    assert j["arrays"] == ["999990"] and [x["state"] for x in j["points"]] == ["COMPLETED", "FAILED"]


def test_unknown_sweep_and_missing_resubmit_choice_are_one_line_errors(tmp_path):
    for args, needle in [(["status", "nope"], "sweep 'nope' not found"),
                         (["resubmit", str(tmp_path)], "--failed"), (["status"], "missing the sweep")]:
        p = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "sweep", *args, "--sweeps-dir", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and needle in p.stderr and p.stderr.count("\n") == 1, p.stderr
