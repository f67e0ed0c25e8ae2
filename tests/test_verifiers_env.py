"""verifiers environments run as they are (orchestrator/verifiers_env.py, data/verifiers_tasks.py): a verifiers 0.4
(`verifiers.v1`) single-agent environment written here, over a local taskset with a reward and a metric, plays its
episodes through verifiers' own harness program and interception server against a real rollout server, through the
run's agent front. What hpc-rl trains on equals what verifiers recorded; a run trains and evaluates through it; what
cannot run on a Slurm node is refused with one line."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpc_rl.config import TinyModelConfig
from hpc_rl.data.toy import LOOKUP_CHAT_TEMPLATE
from hpc_rl.errors import ConfigError, DataError
from hpc_rl.metrics import read_metrics
from hpc_rl.models import load_tokenizer
from hpc_rl.models.tiny import build_tiny_model
from hpc_rl.rollout.testing import make_run, start_server, stop_server

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

# A verifiers environment as a user writes one: a taskset of tasks, each with its reward and a metric.
ENV_MODULE = '''
from verifiers.v1 import State, Task, TaskConfig, TaskData, Taskset, TasksetConfig, Trace
from verifiers.v1.utils.decorators import metric, reward


def _reply(trace: Trace) -> str:
    return str(trace.messages[-1].content or "") if trace.messages else ""


class DigitData(TaskData):
    digit: str


class DigitTask(Task[DigitData, State, TaskConfig]):
    @reward(weight=1.0)
    async def repeats(self, trace: Trace) -> float:
        if self.data.id == "digit-7":
            raise ValueError("task 7 cannot be scored")
        chars = _reply(trace).replace(" ", "")[:4]
        return sum(c == self.data.digit for c in chars) / 4

    @metric
    async def reply_chars(self, trace: Trace) -> float:
        return float(len(_reply(trace)))


class DigitsConfig(TasksetConfig):
    size: int = 8


class DigitTaskset(Taskset[DigitTask, DigitsConfig]):
    def load(self):
        for i in range(self.config.size):
            d = str(i % 10)
            yield DigitTask(DigitData(prompt=f"{d} {d} {d}", digit=d, id=f"digit-{i}"))


__all__ = ["DigitTaskset"]
'''
CORPUS = [" ".join(str((i + k) % 10) for k in range(6)) for i in range(200)]


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory):
    """The environment's module on sys.path (and PYTHONPATH for the runs), as an installed environment is."""
    d = tmp_path_factory.mktemp("vf-env")
    (d / "vf_digits.py").write_text(textwrap.dedent(ENV_MODULE))
    sys.path.insert(0, str(d))
    yield d
    sys.path.remove(str(d))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(TinyModelConfig(), CORPUS, tmp_path_factory.mktemp("vf-model") / "tiny",
                            chat_template=LOOKUP_CHAT_TEMPLATE)


NULL_HARNESS = {"agent": {"harness": {"id": "null"}}}


def _cfg(model_dir, *extra):
    from hpc_rl import config

    return config.load(str(REPO / "jobs" / "toy-agent-cpu.yaml"), [
        "model.tiny=null", f"model.path={model_dir}", "rollout.agent=null", "rollout.agent_kwargs={}",
        "rollout.env=verifiers:vf_digits",
        "rollout.env_kwargs={agent: {harness: {id: 'null'}}}", "data.source=verifiers:vf_digits",
        "data.kwargs={size: 8}", "data.max_prompt_tokens=16", "rollout.max_model_len=40", *extra])


def test_a_verifiers_episode_trains_on_the_engines_tokens_of_what_verifiers_recorded(env_dir, model_dir, tmp_path):
    """Each episode: verifiers' null harness program (run with the run's own Python, no uv download) streams its
    chat call through verifiers' interception server to the episode's URL on the agent front; the recorded sample
    is the engine's tokens of exactly the reply verifiers recorded, its prompt the chat template's rendering of the
    task's prompt, and its reward and metric verifiers' own."""
    from hpc_rl.data.verifiers_tasks import verifiers_rows
    from hpc_rl.orchestrator.agent_front import AgentFront
    from hpc_rl.orchestrator.agents import AgentRollout, agent_batch
    from hpc_rl.orchestrator.verifiers_env import VerifiersEnv
    from hpc_rl.rollout.client.rollout_client import RolloutClient
    from hpc_rl.rollout.wire.openai_api import Defaults
    from hpc_rl.rollout.wire.protocol import RequestLimits

    run = make_run(tmp_path / "runs", model_dir, max_model_len=40, max_samples_per_request=512)
    proc, _ = start_server(run, 0, timeout_s=120)
    try:
        cfg = _cfg(model_dir)
        tok = load_tokenizer(str(model_dir))
        rows = verifiers_rows("verifiers:vf_digits", {"size": 8})
        assert [r["prompt"] for r in rows[:2]] == ["0 0 0", "1 1 1"] and rows[3]["verifiers_task"]["digit"] == "3"
        env = VerifiersEnv("verifiers:vf_digits", NULL_HARNESS, {"size": 8})
        recorded = []
        play = env.env.run_episode

        async def recording(task, ctx, **kw):  # keeps what verifiers recorded of each episode
            episode = await play(task, ctx, **kw)
            recorded.append((task.data.digit, episode))
            return episode

        env.env.run_episode = recording
        client = RolloutClient(run, run.read_token(), timeout_s=60, retries=0)
        front = AgentFront(tok, client, [tok.eos_token_id], RequestLimits(40), len(tok), run.read_token(), "m")
        agents = AgentRollout(cfg, front, env)
        try:
            results = agents.run(rows, 0, lambda ep, k: 10 * ep + k, Defaults(4, 1.0, 1.0, -1))
        finally:
            front.shutdown()
    finally:
        stop_server(proc)
    # An episode whose scoring raised is lost with verifiers' error (counted, its slot kept), not the run.
    assert [r.error for r in results[:7]] == [None] * 7
    assert results[7].error.startswith("raised RuntimeError: the verifiers episode failed: ") and \
        "task 7 cannot be scored" in results[7].error, results[7].error
    by_digit = {digit: ep for digit, ep in recorded}
    for row, r in zip(rows[:7], results[:7]):
        (trace,) = by_digit[row["verifiers_task"]["digit"]].traces
        (call,) = r.calls
        (sample,) = r.samples
        reply = str(trace.messages[-1].content)
        assert tok.decode(sample.response, skip_special_tokens=True) == reply and sample.response == \
            call.completion_ids
        want = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
        assert sample.prompt == tok(want, add_special_tokens=False)["input_ids"]
        assert r.reward == trace.reward and r.metrics == {"reply_chars": float(len(reply))}
    batch, _, stats = agent_batch(results, rows, 2, 0, [[1]] * 4, tok)
    assert batch.reward_parts["environment"] == [r.reward for r in results[:7]] + [results[6].reward]
    assert stats["agent/failed_frac"] == 1 / 8
    assert stats["agent/reply_chars"] == pytest.approx(sum(r.metrics["reply_chars"] for r in results[:7]) / 7)


def test_what_a_slurm_node_cannot_run_is_refused_with_one_line(env_dir, model_dir):
    from hpc_rl.data.verifiers_tasks import verifiers_rows
    from hpc_rl.orchestrator.verifiers_env import VerifiersEnv

    cases = [
        ({"agent": {"runtime": {"type": "docker"}}}, "rollout.env_kwargs.agent.runtime.type: 'docker' needs a "
                                                     "container daemon"),
        ({"agent": {"harness": {"id": "claude_code"}}}, "rollout.env_kwargs.agent.harness.id: 'claude_code' "
                                                        "installs a program in a container"),
        ({"taskset": {"size": 3}}, "rollout.env_kwargs.taskset: the taskset's config is data.kwargs"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as e:
            VerifiersEnv("verifiers:vf_digits", kwargs, {})
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="verifiers loads an environment by its top-level module"):
        VerifiersEnv("verifiers:my.envs.digits", NULL_HARNESS)
    with pytest.raises(ConfigError, match="rollout.env: verifiers:vf_nowhere: .*vf_nowhere"):
        VerifiersEnv("verifiers:vf_nowhere", NULL_HARNESS)
    with pytest.raises(DataError, match=r"data.kwargs.size: Input should be a valid integer"):
        verifiers_rows("verifiers:vf_digits", {"size": "many"})
    with pytest.raises(ConfigError, match="data.source: 'toy:lookup'; a verifiers environment plays its own "
                                          "taskset's tasks: set data.source: verifiers:vf_digits"):
        _cfg(model_dir, "data.source=toy:lookup")
    with pytest.raises(ConfigError, match="rollout.agent_kwargs: set, but there is no rollout.agent"):
        _cfg(model_dir, "rollout.agent_kwargs={model: toy}")

    from hpc_rl.doctor_checks import job as job_checks
    from hpc_rl.doctor_checks.base import FAIL, OK, Ctx

    ok = job_checks.check_agent(Ctx(job=_cfg(model_dir)))
    assert ok.status == OK and "verifiers:vf_digits loads" in ok.message
    bad = job_checks.check_agent(Ctx(job=_cfg(model_dir, "rollout.env_kwargs={agent: {runtime: {type: modal}}}")))
    assert bad.status == FAIL and "'modal' needs a container daemon" in bad.message


def test_a_run_trains_and_evaluates_through_a_verifiers_environment(env_dir, model_dir, tmp_path):
    """`hpc-rl run` of the toy agent job with the environment instead of the agent: two steps on two ranks, every
    episode verifiers', its reward the environment part and its metric agent/reply_chars; evaluation (its taskset
    with other kwargs) plays it too. Small: each of verifiers' episodes starts its harness program, a Python
    process (~1 CPU-s here)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(env_dir), str(REPO)]))
    r = subprocess.run([sys.executable, "-m", "hpc_rl.cli", "run", str(REPO / "jobs" / "toy-agent-cpu.yaml"),
                        "checkpoint.every=0", "model.tiny=null", f"model.path={model_dir}", "rollout.agent=null",
                        "rollout.agent_kwargs={}",
                        "rollout.env=verifiers:vf_digits", "rollout.env_kwargs={agent: {harness: {id: 'null'}}}",
                        "data.source=verifiers:vf_digits", "data.kwargs={size: 7}", "data.max_prompt_tokens=16",
                        "rollout.max_model_len=40", "trainer.steps=2", "trainer.prompts_per_step=2",
                        "algorithm.group_size=4", "trainer.mini_batch_size=8",
                        "eval.source=verifiers:vf_digits", "eval.kwargs={size: 2}", "eval.every=2",
                        "eval.samples_per_prompt=2", "eval.temperature=1.0"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (run,) = list((tmp_path / "runs").iterdir())
    rows = read_metrics(run / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["agent/failed_frac"] == 0.0 and row["agent/calls_per_episode"] == 1.0
        assert 0.0 <= row["reward_mean"] <= 1.0 and row["agent/reply_chars"] > 0, row
    evals = read_metrics(run / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2] and all(e["eval/prompts"] == 2 for e in evals)
    assert len(read_metrics(run / "eval" / "step_2.jsonl")) == 4


def test_a_harness_program_whose_dependencies_this_python_lacks_is_named():
    """The run's Python stands in for uv: a program's PEP 723 dependencies must be installed, at a matching version."""
    import importlib.metadata

    from hpc_rl.orchestrator.verifiers_env import missing_requirements

    script = (b'# /// script\n# requires-python = ">=3.10"\n'
              b'# dependencies = ["packaging", "no-such-dist-hpc-rl", "pytest<1"]\n# ///\nprint("hi")\n')
    assert missing_requirements(script) == [
        "no-such-dist-hpc-rl", f"pytest<1 (installed: {importlib.metadata.version('pytest')})"]
    assert missing_requirements(b'print("no metadata")\n') == []
