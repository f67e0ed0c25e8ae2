"""The reward model where a job places it: a ZeRO-3 inference engine over 2 trainer ranks (each holds its shard)
and a rollout server's /v1/score (the run's token required); both score as the plain model does."""

import json
import os

import pytest
import requests
import torch.multiprocessing as mp

from hpc_rl import config
from hpc_rl.config import RewardModelConfig
from hpc_rl.netutil import free_port
from hpc_rl.rewards.model import HeadTap, load_reward_module, score_sequences

pytestmark = pytest.mark.slow

# Toy-task token rows of different lengths (prompt + response, some ending with eos).
ROWS = [[22, 18, 9, 19, 9, 9, 1], [22, 18, 5, 19], [22, 18, 7, 19, 7, 7, 7, 7, 7, 1], [22, 18, 3, 19, 30, 1]]


def _plain_scores(rm_dir, rows=ROWS):
    cfg = config.load_dict({"model": {"path": str(rm_dir)}})
    model, tok, label = load_reward_module(RewardModelConfig(path=str(rm_dir)), cfg)
    return score_sequences(HeadTap(model, label), rows, 1, tok.pad_token_id, "cpu").tolist()


def _rank(rank: int, world: int, port: int, rm_dir: str, policy_dir: str, out_dir: str) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from hpc_rl.train.distributed import all_gather_floats, init_distributed, shutdown_distributed
    from hpc_rl.train.engines import build_reward_model

    cfg = config.load_dict({"model": {"path": policy_dir}, "trainer": {"device": "cpu", "prompts_per_step": 2, "mini_batch_size": 16},
                            "reward": {"function": None, "model": {"path": rm_dir, "batch_size": 2}}})
    init_distributed(cfg)
    engine, tok, label = build_reward_model(cfg, world, "cpu")
    shards = {n: [int(p.ds_tensor.numel()), int(p.ds_numel)] for n, p in engine.module.named_parameters()}
    # Rank 0 scores 3 rows, rank 1 one: both run 2 forwards (ZeRO-3 gathers every layer from all ranks).
    mine = ROWS[:3] if rank == 0 else ROWS[3:]
    scores = score_sequences(HeadTap(engine, label), mine, 2, tok.pad_token_id, "cpu", batches=2)
    gathered = all_gather_floats(list(scores) + [0.0] * (3 - len(scores)))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"shards": shards, "scores": gathered.tolist()}, f)
    del engine
    shutdown_distributed()


def test_reward_model_on_two_zero3_ranks(tiny_reward_model, tiny_model, tmp_path):
    world = 2
    mp.spawn(_rank, args=(world, free_port("127.0.0.1"), str(tiny_reward_model), str(tiny_model), str(tmp_path)),
             nprocs=world, join=True)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    r1 = json.loads((tmp_path / "rank1.json").read_text())
    assert r0["shards"].keys() == r1["shards"].keys() and any("score" in n for n in r0["shards"])
    for name, (local, full) in r0["shards"].items():
        assert local == (full + world - 1) // world and local < full, (name, local, full)
    want = _plain_scores(tiny_reward_model)
    got = r0["scores"][:3] + r0["scores"][3:4]
    assert got == pytest.approx(want, abs=1e-4)
    assert r1["scores"] == r0["scores"]


def test_reward_model_on_a_rollout_server(tiny_reward_model, tiny_model, tmp_path):
    from hpc_rl.rollout.client.rollout_client import RolloutClient
    from hpc_rl.rollout.testing import make_run, start_server, stop_server

    run = make_run(tmp_path / "runs", tiny_model, max_model_len=64,
                   reward={"model": {"path": str(tiny_reward_model), "placement": "server", "max_length": 12}})
    proc, info = start_server(run, 0, timeout_s=120)
    try:
        url = info["url"] + "/v1/score"
        r = requests.post(url, json={"token_ids": ROWS}, timeout=30)
        assert r.status_code == 401 and "bearer token" in r.json()["error"]
        s = requests.Session()
        s.headers["Authorization"] = "Bearer " + run.read_token()
        r = s.post(url, json={"token_ids": ROWS}, timeout=30)
        assert r.status_code == 200, r.text
        want = _plain_scores(tiny_reward_model)
        assert r.json()["logits"] == pytest.approx(want, abs=1e-4)
        for body, field in (({"token_ids": [[22, 10_000]]}, "token_ids[0]: token id 10000"),
                            ({"token_ids": [list(range(3, 16))]}, "token_ids[0]: 13 tokens exceed reward.model.max_length 12"),
                            ({"ids": ROWS}, "ids: unknown field")):
            r = s.post(url, json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"].startswith(field), r.text
        client = RolloutClient(run, run.read_token(), timeout_s=30)
        assert client.score(ROWS) == pytest.approx(want, abs=1e-4)
        assert "reward model" in (run.logs / "rollout-0.log").read_text()
    finally:
        stop_server(proc)


def _run(tmp_path, *overrides):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", str(repo / "jobs" / "toy-ppo-rm-cpu.yaml"),
                           "checkpoint.every=0", "trainer.steps=3", "reward.model.placement=server", "reward.nodes=1",
                           *overrides], capture_output=True, text=True, cwd=tmp_path, timeout=900)


def test_reward_node_server_scores_for_the_run(tiny_reward_model, tmp_path):
    """reward.nodes=1 in `hpc-rl run`: a reward server of its own (logs/reward-0.log, the run's token), the rollout
    server does not load the reward model, and the steps carry its scores."""
    from hpc_rl.metrics import read_metrics

    r = _run(tmp_path, f"reward.model.path={tiny_reward_model}", "reward.model.tiny=null")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = list((tmp_path / "runs").iterdir())
    reward_log = (run / "logs" / "reward-0.log").read_text()
    assert "reward model" in reward_log and "reward server 0 serving http://" in reward_log
    assert "reward model" not in (run / "logs" / "rollout-0.log").read_text()
    rows = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 3 and all("reward_model_logit_mean" in row and "monitor_mean" in row for row in rows)


def test_reward_model_on_the_rollout_server_scores_for_the_run(tiny_reward_model, tmp_path):
    """reward.model.placement=server without reward nodes: the rollout server loads the reward model next to the
    policy, the trainer ranks hold none, and the steps carry its scores."""
    from hpc_rl.metrics import read_metrics

    r = _run(tmp_path, "reward.nodes=0", f"reward.model.path={tiny_reward_model}", "reward.model.tiny=null")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = list((tmp_path / "runs").iterdir())
    assert "reward model" in (run / "logs" / "rollout-0.log").read_text()
    assert not (run / "logs" / "reward-0.log").exists()
    rows = read_metrics(run / "metrics.jsonl")
    assert len(rows) == 3 and all("reward_model_logit_mean" in row and "reward_model_seconds" not in row
                                  for row in rows)


def test_reward_server_that_cannot_start_ends_the_run_in_one_line(tiny_reward_model, tmp_path):
    """A reward model whose weights do not load (its config and tokenizer do: the run starts): the reward server
    dies before it serves and the run stops at once with one line naming it and its log."""
    import shutil

    broken = tmp_path / "broken-rm"
    shutil.copytree(tiny_reward_model, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    r = _run(tmp_path, f"reward.model.path={broken}", "reward.model.tiny=null")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if "reward server 0 on node" in ln]
    assert lines and "exited with code 1 before it served (a startup failure is not retried)" in lines[0], lines
    assert "(full log: logs/reward-0.log)" in lines[0]
