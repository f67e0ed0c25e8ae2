"""Experiment tracking (W&B offline files, an MLflow file store; no network): the trackers hold metrics.jsonl's
numbers at the same steps, a killed and resumed run continues the same tracked runs without a doubled step, a
tracker that cannot reach its server does not stop training, `hpc-rl sync` lists and refuses clearly."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_rl import config, tracking
from hpc_rl.errors import ConfigError
from hpc_rl.metrics import read_metrics
from hpc_rl.netutil import free_port
from hpc_rl.rewards.toy import repeat_digit

from .local_run import poll, procs_of

REPO = Path(__file__).resolve().parent.parent
TOY = REPO / "jobs" / "toy-grpo-cpu.yaml"
SMALL = ["trainer.prompts_per_step=8", "trainer.mini_batch_size=32", "logging.tensorboard=false"]


def _hpc_rl(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "hpc_rl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def _numbers(d: dict) -> dict:
    return {k: float(v) for k, v in d.items() if not k.startswith(("_", "plots/")) and isinstance(v, (int, float))}


# --------------------------------------------------------------------------- without a run


def test_tracked_metrics_are_the_rows_numbers_but_step_and_time():
    row = {"step": 3, "time": 1.5, "reward_mean": 0.25, "kl": 0.0, "prompt_ids": [1, 2], "engine": "hf"}
    assert tracking.tracked_metrics(row) == {"reward_mean": 0.25, "kl": 0.0}


def test_a_tracker_without_its_library_is_a_one_line_error_naming_the_extra(monkeypatch):
    cfg = config.load(TOY, ["logging.wandb.mode=offline"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` sees where it is not installed
    with pytest.raises(ConfigError) as e:
        tracking.check_installed(cfg)
    assert str(e.value).startswith("logging.wandb.mode: tracking needs the wandb package")
    assert "hpc-rl[tracking]" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError, match=r"^logging.mlflow: tracking needs the mlflow-skinny package"):
        tracking.check_installed(config.load(TOY, ["logging.mlflow.experiment=toy"]))
    tracking.check_installed(config.load(TOY))  # both off: nothing needed


def test_wandb_files_read_back_what_the_sdk_wrote_and_stop_at_a_cut(tmp_path, monkeypatch):
    """The reader of W&B's run files (resume and sync rely on it) against files the real SDK wrote offline,
    over two attempts of one run id; a file cut mid-record yields its complete records only."""
    import wandb

    monkeypatch.setenv("WANDB_SERVICE", "")  # wandb names its service here; restored (unset) after the test

    started = 0
    for steps in ([1, 2, 3], [4, 5]):
        # W&B names an attempt's folder by the second it started in: two attempts in one second share a folder and
        # the second one's records are lost. Real attempts are a requeue apart; here the second waits for the next
        # second.
        while int(time.time()) <= started:
            time.sleep(0.05)
        run = wandb.init(project="p", id="abc12345", resume="allow", mode="offline", dir=str(tmp_path), group="g",
                         config={"algorithm": {"name": "grpo"}}, settings=wandb.Settings(console="off", silent=True))
        started = int(time.time())
        for s in steps:
            run.log({"reward_mean": s / 10, "long": "x" * 70_000 if s == 2 else 0.0}, step=s)  # spans 3 blocks
        run.finish()
        wandb.teardown()  # as a job's end does: finish() returns before the service has written the last block
    dirs = tracking.wandb_run_dirs(tmp_path, "abc12345")
    assert len(dirs) == 2 and tracking.wandb_run_dirs(tmp_path, "other") == []
    hist = [h for d in dirs for h in tracking.wandb_history(d)]
    assert [h["_step"] for h in hist] == [1, 2, 3, 4, 5]
    assert [h["reward_mean"] for h in hist] == [0.1, 0.2, 0.3, 0.4, 0.5] and len(hist[1]["long"]) == 70_000
    rec = tracking.wandb_run_record(dirs[0])
    assert rec["id"] == "abc12345" and rec["group"] == "g" and rec["config"]["algorithm"] == {"name": "grpo"}
    f = next(dirs[0].glob("run-*.wandb"))
    data = f.read_bytes()
    cut = data.index(b"x" * 100) + 50_000  # inside the long record
    f.write_bytes(data[:cut])
    assert [h["_step"] for h in tracking.wandb_history(dirs[0])] == [1]


def _start_mlflow_point(sweep_root: str, index: int, barrier) -> None:
    from hpc_rl import rundir

    run = rundir.create(Path(sweep_root) / "points", f"{index:02d}")
    info = tracking.RunInfo(run.name, {}, {"dir": "kl-sweep", "path": sweep_root, "index": index, "label": str(index)})
    cfg = config.load(TOY)
    run.job_yaml.write_text(TOY.read_text())
    barrier.wait(timeout=60)
    tracking._Mlflow(cfg, run, info).start({})


def test_points_of_a_sweep_starting_together_share_one_mlflow_experiment(tmp_path):
    """A folder store does not make experiment names unique: points that start at once once created one experiment
    each, and the sweep's experiment missed runs (seen in CI: 3 of 4)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    tracking.mlflow_client((tmp_path / "mlruns").as_uri())  # the points' imports are done: they race to create
    n = 6
    barrier = ctx.Barrier(n)
    procs = [ctx.Process(target=_start_mlflow_point, args=(str(tmp_path), i, barrier)) for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * n
    client = tracking.mlflow_client((tmp_path / "mlruns").as_uri())
    exps = [e for e in client.search_experiments() if e.name == "kl-sweep"]
    assert len(exps) == 1, [e.experiment_id for e in exps]
    assert len(client.search_runs([exps[0].experiment_id])) == n


def test_eval_metrics_reach_the_trackers_at_the_step_they_evaluated(tmp_path, monkeypatch):
    """An evaluation joins the metrics row of a later step (async rollouts): W&B gets it in that row with eval/step
    (its charts of eval/* use it as their x axis), MLflow at the evaluated step, with '@' spelled _at_ (MLflow
    refuses '@' in a metric name)."""
    from hpc_rl.rundir import RunDir

    monkeypatch.setenv("WANDB_SERVICE", "")
    run = RunDir(tmp_path / "run")
    run.ensure_layout()
    cfg = config.load(TOY, ["logging.wandb.mode=offline", "logging.mlflow.experiment=toy"])
    run.job_yaml.write_text(config.dump(cfg))
    t = tracking.Tracker(cfg, run)
    t.log(1, {"step": 1, "time": 1.0, "reward_mean": 0.1})
    t.log(2, {"step": 2, "time": 2.0, "reward_mean": 0.2, "eval/step": 1, "eval/pass@1": 0.25, "eval/mean@4": 0.5})
    t.close("preempted")  # no curves PNG: nothing else in the histories
    ids = json.loads((run.root / "tracking.json").read_text())
    (hist,) = [tracking.wandb_history(d) for d in tracking.wandb_run_dirs(run.root, ids["wandb"]["id"])]
    assert [(h["_step"], h.get("eval/step"), h.get("eval/pass@1")) for h in hist] == [(1, None, None), (2, 1, 0.25)]
    client = tracking.mlflow_client(ids["mlflow"]["tracking_uri"])
    runid = ids["mlflow"]["run_id"]
    assert [(m.step, m.value) for m in client.get_metric_history(runid, "eval/pass_at_1")] == [(1, 0.25)]
    assert [(m.step, m.value) for m in client.get_metric_history(runid, "eval/mean_at_4")] == [(1, 0.5)]
    assert [m.step for m in client.get_metric_history(runid, "reward_mean")] == [1, 2]


# --------------------------------------------------------------------------- real runs


_calls = 0


def gated_reward(prompt: str, completion: str, ground_truth: str, **kw) -> float:
    """The toy reward; from the GATE_AFTER-th sample on it waits while the file $TRACKING_GATE exists (holds a run
    between two steps, so that a kill lands where the test wants it)."""
    global _calls
    _calls += 1
    gate = Path(os.environ.get("TRACKING_GATE", "/nonexistent"))
    deadline = time.time() + 600
    while _calls > int(os.environ.get("GATE_AFTER", "0")) and gate.exists() and time.time() < deadline:
        time.sleep(0.1)
    return repeat_digit(prompt, completion, ground_truth)


def _start(cwd: Path, log: Path, env: dict, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpc_rl.cli", "run", str(TOY), *args], cwd=cwd,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **env))


@pytest.mark.slow
def test_killed_and_resumed_run_continues_the_same_tracked_runs_without_doubled_steps(tmp_path):
    """W&B offline + MLflow file store. SIGKILL after step 4 (checkpoint at 3; step 5 held by its reward), resume:
    the same W&B id and MLflow run; each of steps 1-6 held once (none missing: steps up to the checkpoint that a
    tracker lost with the kill come from metrics.jsonl); steps a tracker held before the kill (MLflow: 4) keep those
    values (skipped on resume), later ones equal the resumed metrics.jsonl; config = the job spec; the curves PNG."""
    steps, samples = 6, 8 * 8
    args = [f"trainer.steps={steps}", "checkpoint.every=3", *SMALL, "logging.wandb.mode=offline",
            "logging.mlflow.experiment=toy", "reward.function=tests.test_tracking:gated_reward"]
    gate = tmp_path / "gate"
    gate.touch()
    # WANDB_SERVICE: a W&B service of the process that started the job (here: none that answers) is not the run's.
    env = {"PYTHONPATH": str(REPO), "TRACKING_GATE": str(gate), "GATE_AFTER": str(4 * samples),
           "WANDB_SERVICE": f"3-{os.getpid()}-unix-{tmp_path / 'no-such-socket'}"}
    log = tmp_path / "first.log"
    proc = _start(tmp_path, log, env, *args)
    try:
        run = poll("the run dir", lambda: next((tmp_path / "runs").glob("*/job.yaml"), None), 300, proc, log).parent

        def mlflow_holds_step_4():  # and W&B has started (its first attempt's folder exists)
            ids = json.loads((run / "tracking.json").read_text()) if (run / "tracking.json").is_file() else {}
            log0 = run / "logs" / "trainer-0.log"
            if "mlflow" not in ids or not log0.is_file() or "W&B: offline run" not in log0.read_text():
                return False
            client = tracking.mlflow_client(ids["mlflow"]["tracking_uri"])
            return any(m.step == 4 for m in client.get_metric_history(ids["mlflow"]["run_id"], "reward_mean"))

        poll("MLflow to hold step 4 and W&B to start", mlflow_holds_step_4, 600, proc, log, every=0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    gate.unlink()
    deadline = time.time() + 60
    while procs_of(run) and time.time() < deadline:  # ranks and servers die with the launcher (PDEATHSIG)
        time.sleep(0.2)
    assert not procs_of(run)
    before = {r["step"]: r for r in read_metrics(run / "metrics.jsonl")}
    ids = json.loads((run / "tracking.json").read_text())
    wb_id, ml = ids["wandb"]["id"], ids["mlflow"]
    held_wandb = max((h["_step"] for d in tracking.wandb_run_dirs(run, wb_id) for h in tracking.wandb_history(d)),
                     default=0)
    client = tracking.mlflow_client(ml["tracking_uri"])
    held_mlflow = max((m.step for m in client.get_metric_history(ml["run_id"], "reward_mean")), default=0)
    assert max(before) == 4 and held_mlflow == 4 and held_wandb <= 4, (max(before), held_mlflow, held_wandb)

    r = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", str(TOY), "--resume", str(run)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, **env))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((run / "tracking.json").read_text()) == ids  # the same tracked runs
    rows = {row["step"]: row for row in read_metrics(run / "metrics.jsonl")}
    assert sorted(rows) == list(range(1, steps + 1))
    log0 = (run / "logs" / "trainer-0.log").read_text()
    assert "resumed from" in log0 and "Traceback" not in log0 and "failed to" not in log0
    assert "tracking: MLflow already holds steps up to 4" in log0  # step 4 came after the checkpoint: skipped
    if held_wandb > 3:
        assert f"tracking: W&B already holds steps up to {held_wandb}" in log0

    def want(step, held):
        return tracking.tracked_metrics(before[step] if step <= held else rows[step])

    # W&B: two attempt folders of one id; every step once.
    dirs = tracking.wandb_run_dirs(run, wb_id)
    assert len(dirs) == 2 and all(d.name.startswith("offline-run-") for d in dirs)
    hist = [h for d in dirs for h in tracking.wandb_history(d)]
    assert [h["_step"] for h in hist] == list(range(1, steps + 1))
    for h in hist:
        assert _numbers(h) == want(h["_step"], held_wandb), h["_step"]
    assert any("plots/curves/path" in h for h in hist if h["_step"] == steps)  # the PNG, at the last step
    rec = tracking.wandb_run_record(dirs[-1])
    assert rec["id"] == wb_id and rec["name"] == run.name and rec["project"] == "hpc-rl"
    spec = json.loads(json.dumps(dataclasses.asdict(config.load(run / "job.yaml"))))
    assert {k: v for k, v in rec["config"].items() if k != "_wandb"} == spec  # the resolved job spec

    # MLflow: one run; each metric's history has every step once, with the values above.
    mr = client.get_run(ml["run_id"])
    assert mr.info.status == "FINISHED" and mr.info.run_name == run.name
    assert mr.data.params["algorithm.name"] == "grpo" and mr.data.params["trainer.steps"] == str(steps)
    for key in ("reward_mean", "policy_loss", "step_seconds"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(ml["run_id"], key))
        assert [s for s, _ in got] == list(range(1, steps + 1)), key
        assert got == [(s, want(s, held_mlflow)[key]) for s in range(1, steps + 1)], key
    assert set(mr.data.metrics) == set(tracking.tracked_metrics(rows[steps]))
    arts = {a.path for a in client.list_artifacts(ml["run_id"])} | {
        a.path for a in client.list_artifacts(ml["run_id"], "plots")}
    assert {"job.yaml", "plots/curves.png"} <= arts

    # hpc-rl sync: lists both attempts; without a reachable W&B it says so in one line and uploads nothing.
    dry = _hpc_rl("sync", str(run), "--dry-run")
    # (an attempt killed before W&B's process wrote anything has an empty file: skipped, its steps came back above)
    listed = dry.stdout.count(f"would sync {run}/wandb/offline-run-")
    assert dry.returncode == 0 and listed >= 1 and listed + dry.stdout.count("skipping ") == 2, dry.stdout
    assert f"W&B run {wb_id} (project hpc-rl, steps 1-" in dry.stdout and "MLflow file store" in dry.stdout
    off = _hpc_rl("sync", str(run), env={"WANDB_BASE_URL": f"http://127.0.0.1:{free_port('127.0.0.1')}"})
    assert off.returncode == 2 and off.stderr.count("\n") == 1, off.stderr
    assert off.stderr.startswith("hpc-rl: error: cannot reach W&B at http://127.0.0.1:")
    assert not list(run.glob("wandb/*/*.synced"))


@pytest.mark.slow
def test_trackers_that_cannot_reach_their_servers_do_not_stop_training(tmp_path):
    """W&B online and MLflow at an address where nothing listens: the run completes, metrics.jsonl has every
    step, and each tracker's failure is one warning line."""
    closed = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    env = {"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": closed, "WANDB_INIT_TIMEOUT": "5",
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    r = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", str(TOY), "trainer.steps=2", "checkpoint.every=0",
                        *SMALL, "logging.wandb.mode=online", f"logging.mlflow.tracking_uri={closed}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=900, env=dict(os.environ, **env))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert [row["step"] for row in read_metrics(run / "metrics.jsonl")] == [1, 2]
    out = r.stdout + r.stderr
    for name in ("W&B", "MLflow"):
        lines = [ln for ln in out.splitlines() if f"tracking: {name} failed to start" in ln]
        assert len(lines) == 1 and "metrics.jsonl has every step" in lines[0], out[-3000:]
    assert "Traceback" not in out and "run finished" in out
