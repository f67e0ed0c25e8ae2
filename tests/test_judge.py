"""LLM-as-judge rewards (reward.judge, services.judge): the parsers and the template, the checks at load (one line,
no run dir), a judge at an OpenAI-compatible URL (the run's own rollout server's chat route stands in for a hosted
API: a real server, a real key check) that answers garbage (the fallback, counted) or refuses the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hpc_rl import config
from hpc_rl.config.reward import JudgeConfig
from hpc_rl.errors import ConfigError, RewardError
from hpc_rl.rewards.judge import check_template_variables, compile_template, make_parser, render, yes_no

from .runs import hpc_rl

REPO = Path(__file__).resolve().parent.parent
TOY = str(REPO / "jobs" / "toy-judge-cpu.yaml")


def raising_parser(answer, row):
    raise KeyError("verdict")


def half_parser(answer, row):
    return 0.5 if "maybe" in answer else None


def test_yes_no_and_score_parsers():
    assert [yes_no(a) for a in ("Yes.", " no", "YES, it is", "'No'", "maybe", "", "yesterday")] == \
        [1.0, 0.0, 1.0, 0.0, None, None, None]
    score = make_parser(JudgeConfig(parser="score", score_range=[1, 5], regex=r"Score: (\d+)"))
    assert [score(a, {}) for a in ("Score: 5", "score 3", "Score: 3 of 5", "Score: 9")] == [1.0, None, 0.5, None]
    assert make_parser(JudgeConfig(parser="tests.test_judge:half_parser"))("maybe so", {}) == 0.5
    with pytest.raises(RewardError, match=r"reward.judge.parser tests.test_judge:raising_parser raised KeyError on "
                                          r"the answer 'yes'"):
        make_parser(JudgeConfig(parser="tests.test_judge:raising_parser"))("yes", {})


def test_the_template_sees_the_sample_and_its_row():
    t = compile_template("Q: {{ prompt }} A:{{ completion }} ref {{ ground_truth }}")
    assert render(t, "copy 1 2 :", " 1 2", {"ground_truth": "1 2", "id": 0}) == "Q: copy 1 2 : A: 1 2 ref 1 2"
    with pytest.raises(ConfigError, match="reward.judge.template: unknown variable 'answer'; the template sees prompt, "
                                          "completion and the row's fields"):
        check_template_variables("{{ prompt }} {{ answer }}", {"prompt": "x", "id": 0})


def test_the_judge_sections_are_checked_at_load():
    cfg = config.load(TOY)
    assert cfg.reward.parts == ["judge"] and cfg.services.judge.servers == 1
    for overrides, msg in [
        (["services.judge=null"], "reward.judge: an LLM judge needs services.judge"),
        (["reward.judge=null", "reward.function=hpc_rl.rewards.toy:copy_pair"], "services.judge: a judge serves "
                                                                                "reward.judge"),
        (["services.judge.url=http://x/v1"], "services.judge: set path (an HF folder served by the run) or url"),
        (["services.judge.path=null", "services.judge.url=http://x/v1"], "services.judge.model: name the model"),
        (["reward.judge.regex=(unclosed"], "reward.judge.regex: '(unclosed' is not a regex"),
        (["reward.judge.score_range=[5, 1]"], "reward.judge.score_range: two numbers [low, high] with low < high"),
        (["reward.judge.parser=nonsense"], "reward.judge.parser: 'nonsense'; use yes_no, score or pkg.module:function"),
        (["reward.judge.template={{ unclosed"], "reward.judge.template: not a valid jinja2 template"),
    ]:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            config.load(TOY, overrides)


@pytest.mark.parametrize("override,expect", [
    ("reward.judge.template={{ prompt }} {{ verdict }}", "reward.judge.template: unknown variable 'verdict'"),
    ("reward.judge.parser=tests.test_judge:raising_parser", "reward.judge.parser tests.test_judge:raising_parser "
                                                           "raised KeyError"),
])
def test_a_bad_template_or_parser_stops_before_the_run_starts(tmp_path, override, expect):
    p = hpc_rl("run", TOY, override, f"output_dir={tmp_path / 'runs'}", cwd=REPO)
    err = p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""
    assert p.returncode == 2 and "Traceback" not in p.stderr and err.startswith("hpc-rl: error: "), p.stderr[-2000:]
    assert expect in err, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.slow
def test_a_judge_at_a_url_checks_its_key_and_falls_back_on_garbage(tmp_path, monkeypatch):
    """The endpoint is a rollout server's OpenAI chat route (its token is the API key) serving a random tiny model:
    its answers are no yes or no, so every sample gets the fallback and counts as failed; a wrong key is refused
    with one line naming the variable."""
    from hpc_rl.config import TinyModelConfig
    from hpc_rl.data.toy import LOOKUP_CHAT_TEMPLATE
    from hpc_rl.models.tiny import build_tiny_model
    from hpc_rl.orchestrator.judge import Judge
    from hpc_rl.rollout.testing import make_run, start_server, stop_server

    model = build_tiny_model(TinyModelConfig(), ["copy 1 2 : 1 2 ok ? yes no"], tmp_path / "tiny",
                             chat_template=LOOKUP_CHAT_TEMPLATE)
    run = make_run(tmp_path / "runs", model, max_model_len=64)
    proc, info = start_server(run, 0, timeout_s=120)
    try:
        cfg = config.load(TOY, ["services.judge.path=null", f"services.judge.url={info['url']}/v1",
                                "services.judge.model=judge", "services.judge.api_key_env=TEST_JUDGE_KEY",
                                "reward.judge.fallback=0.25", "reward.judge.max_new_tokens=3"])
        monkeypatch.setenv("TEST_JUDGE_KEY", "wrong")
        with pytest.raises(Exception, match=r"services.judge.url: .* refused the key \(HTTP 401, from "
                                            r"\$TEST_JUDGE_KEY\)"):
            Judge(cfg).endpoint.check()
        monkeypatch.setenv("TEST_JUDGE_KEY", run.read_token())
        judge = Judge(cfg)
        judge.endpoint.check()
        rows = [{"id": i, "prompt": "copy 1 2 :", "ground_truth": "1 2"} for i in range(6)]
        out = judge(["copy 1 2 :"] * 6, [" 1 2"] * 6, rows, step=0)
        assert len(out.answers) == 6 and all(isinstance(a, str) for a in out.answers)
        parsed = [yes_no(a) for a in out.answers]
        assert out.failed == parsed.count(None)
        assert out.scores == [0.25 if v is None else v for v in parsed]
        assert out.stats()["judge/parse_failed_frac"] == out.failed / 6
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_a_policy_rewarded_only_by_its_own_judge_learns_the_task(tmp_path):
    """jobs/toy-judge-cpu.yaml as users run it, from an empty directory (the job's sft: paths resolve to the checkout's
    jobs/, and the run's job.yaml holds them absolute): its judge is built by SFT (jobs/toy-judge-sft-cpu.yaml) and served by
    the run; GRPO on the judge's verdicts alone brings the rule that is never trained on (the monitor) to the toys'
    criterion (last 5 steps >= 0.7). The judge's statistics are in every step, it never takes weights, the evaluation
    files keep its answers, and `hpc-rl eval` of the last checkpoint starts the judge beside the policy."""
    import json

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    job = REPO / "jobs" / "toy-judge-cpu.yaml"
    p = hpc_rl("run", job, f"output_dir={tmp_path / 'runs'}", "trainer.stop_at={monitor_mean: 0.7}",
               "eval.every=10", cwd=elsewhere, env={"HPC_RL_DEBUG": "1"}, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (run,) = list((tmp_path / "runs").iterdir())
    resolved = yaml.safe_load((run / "job.yaml").read_text())
    # Both sft: specs (resolved against the checkout) were built and their models copied into the run.
    assert resolved["model"]["path"] == str(run / "model-init"), resolved["model"]
    assert resolved["services"]["judge"]["path"] == str(run / "judge-model"), resolved["services"]
    assert (run / "model-init" / "config.json").is_file() and (run / "judge-model" / "config.json").is_file()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    monitor = [r["monitor_mean"] for r in rows]
    assert sum(monitor[-5:]) / 5 >= 0.7 and len(rows) < 60, monitor
    assert monitor[0] < 0.4, monitor  # the student starts far from it
    for r in rows:
        assert 0 <= r["reward_mean"] <= 1 and r["judge/s"] > 0 and r["judge_seconds"] > 0, r
        assert 0 <= r["judge/parse_failed_frac"] <= 1
    print(f"toy judge: monitor {monitor[0]:.2f} -> {sum(monitor[-5:]) / 5:.2f} (last 5) in {len(rows)} steps; judged "
          f"reward {rows[0]['reward_mean']:.2f} -> {rows[-1]['reward_mean']:.2f}")
    log = (run / "logs" / "trainer-0.log").read_text()
    assert "the judge's answer to sample 0: " in log and "({'judge': " in log, log[-2000:]
    judge_log = (run / "logs" / "judge-0.log").read_text()
    assert "judge server 0 serving" in judge_log and "weights: loaded" not in judge_log
    assert "1 judge server(s)" in p.stdout + p.stderr

    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals][:2] == [0, 10] and all("eval/monitor_mean" in e for e in evals), evals
    samples = [json.loads(line) for line in (run / "eval" / "step_10.jsonl").read_text().splitlines()]
    assert len(samples) == 20 and all({"judge_answer", "judge_score", "monitor"} <= set(x) for x in samples)
    assert all(x["score"] == x["judge_score"] for x in samples)

    p = hpc_rl("eval", str(run), cwd=elsewhere, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (offline,) = list((run / "eval").glob("step_*.offline.jsonl"))
    samples = [json.loads(line) for line in offline.read_text().splitlines()]
    assert len(samples) == 20 and all(isinstance(x["judge_answer"], str) for x in samples)
    row = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()][-1]
    assert row["source"] == "offline" and row["eval/judge/s"] > 0 and row["eval/monitor_mean"] >= 0.5, row

    # An exported model evaluated with the job file: its judge (an sft: spec) is built or taken from the cache; a
    # judge that cannot start stops the evaluation with its error in one line, at once (not after the startup timeout)
    hf = sorted((run / "checkpoints").glob("step_*/hf"))[-1]
    p = hpc_rl("eval", str(hf), "--job", job, f"output_dir={tmp_path / 'model-eval'}", cwd=elsewhere, timeout=600)
    assert p.returncode == 0 and "step 0: pass@1" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    broken = tmp_path / "broken-judge"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen2"}')
    p = hpc_rl("eval", str(hf), "--job", "jobs/toy-judge-cpu.yaml", f"output_dir={tmp_path / 'model-eval'}",
               f"services.judge.path={broken}", cwd=REPO, timeout=120)
    err = p.stderr.strip().splitlines()[-1]
    assert p.returncode != 0 and err.startswith("hpc-rl: error: judge server 0 on node ") and "model.safetensors" in err, \
        p.stderr[-3000:]
