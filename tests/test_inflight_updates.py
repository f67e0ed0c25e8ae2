"""In-flight weight updates (rollout.inflight_updates): a weight load pauses running generations between decoding
steps instead of waiting for them; the samples continue with the new weights, every token carrying the version that
sampled it, and each token's log-prob is exactly its own version's."""

import asyncio
import threading
import time

import pytest
import torch

from hpc_rl.config import TinyModelConfig, load_dict
from hpc_rl.errors import ConfigError, HpcRlError
from hpc_rl.orchestrator.batch import RolloutBatch
from hpc_rl.orchestrator.pipeline import RolloutPipeline
from hpc_rl.rollout.server.engine import StepGate
from hpc_rl.rollout.server.engine_hf import HFEngine
from hpc_rl.rollout.server.service import RolloutService
from hpc_rl.rollout.wire import protocol
from hpc_rl.rollout.wire.protocol import RequestLimits
from hpc_rl.rollout.wire.sampling import SampleOut, SamplingParams
from hpc_rl.rundir import RunDir

CORPUS = [f"{i} + {i} = {2 * i}" for i in range(100)]
PROMPTS = [[5, 6, 7], [8, 9]]
SWAP_AFTER = 3  # model forwards before the swap: the prefill and two decoding steps


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from hpc_rl.models.tiny import build_tiny_model

    return build_tiny_model(TinyModelConfig(), CORPUS, tmp_path_factory.mktemp("m") / "tiny")


def _engine(model_dir) -> HFEngine:
    cfg = load_dict({"model": {"path": str(model_dir)}, "rollout": {"engine": "hf", "async_steps": 1,
                                                                     "inflight_updates": True}})
    return HFEngine(cfg, "cpu")


def _other_weights(engine: HFEngine, seed: int = 3) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in engine.model.state_dict().items()
            if t.is_floating_point()]


class SwapMidway:
    """Holds the engine's forward number `at` until a swap has been asked for, so that the swap lands exactly
    between that forward and the next (a swap waits for the decoding step in progress)."""

    def __init__(self, engine: HFEngine, at: int = SWAP_AFTER):
        self.engine, self.at, self.calls = engine, at, 0
        self.reached = threading.Event()
        self.handle = engine.model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1
        if self.calls == self.at:
            self.reached.set()
            deadline = time.monotonic() + 30
            while not self.engine._steps._wanted and time.monotonic() < deadline:
                time.sleep(0.001)

    def remove(self):
        self.handle.remove()


def _rescored(engine: HFEngine, prompt: list[int], s: SampleOut) -> list[float]:
    return engine.prompt_logprobs([prompt + s.token_ids], [len(prompt)])[0]


def test_a_swap_lands_between_decoding_steps_and_each_token_is_its_versions(model_dir):
    engine = _engine(model_dir)
    old = [(n, t.clone()) for n, t in engine.model.state_dict().items() if t.is_floating_point()]
    new = _other_weights(engine)
    params = SamplingParams(n=2, max_new_tokens=12, seed=7, stop_token_ids=[])
    engine.eos_ids = set()  # every sample runs its 12 tokens, across the swap
    hook = SwapMidway(engine)
    out: dict = {}
    gen = threading.Thread(target=lambda: out.setdefault("samples", engine.generate(PROMPTS, params)))
    gen.start()
    assert hook.reached.wait(30)
    with engine.swapping():
        engine.load_weights(new)
        engine.weights_version = 1
    gen.join(60)
    hook.remove()
    samples = [(p, s) for p, row in zip(PROMPTS, out["samples"]) for s in row]
    for _, s in samples:
        # Forward k gives the logits of token k-1: tokens 0..2 by version 0, the rest (after a re-read of the
        # prefix with the new weights) by version 1.
        assert s.versions == [0] * SWAP_AFTER + [1] * (12 - SWAP_AFTER)
    for p, s in samples:  # the engine holds version 1 now: the later tokens are its
        assert _rescored(engine, p, s)[SWAP_AFTER:] == pytest.approx(s.logprobs[SWAP_AFTER:], abs=1e-5)
        assert max(abs(a - b) for a, b in zip(_rescored(engine, p, s)[:SWAP_AFTER], s.logprobs)) > 1e-3
    engine.load_weights(old)
    for p, s in samples:  # and the first tokens are version 0's
        assert _rescored(engine, p, s)[:SWAP_AFTER] == pytest.approx(s.logprobs[:SWAP_AFTER], abs=1e-5)


def test_the_same_swap_without_inflight_gives_one_version_per_sample(model_dir):
    """Control: with no swap the engine reports its one version for every token (and the service drops it)."""
    engine = _engine(model_dir)
    row = engine.generate([[5, 6]], SamplingParams(n=2, max_new_tokens=5, seed=1))[0]
    assert all(s.versions == [0] * len(s.token_ids) for s in row)
    service = RolloutService(engine, RunDir("/nonexistent"), str(model_dir), RequestLimits(256), None)
    outputs = [row]
    assert service._version_of(outputs) == 0 and all(s.versions is None for s in row)


def test_step_gate_swap_waits_for_the_step_not_the_generation_and_is_not_starved():
    gate = StepGate()
    order = []
    stop = threading.Event()

    def decode():
        while not stop.is_set():  # a generation that would run forever, one step after the other
            with gate.step():
                order.append("step")
                time.sleep(0.002)

    t = threading.Thread(target=decode)
    t.start()
    time.sleep(0.02)
    t0 = time.monotonic()
    with gate.swap():
        n = len(order)
        time.sleep(0.02)
        assert len(order) == n  # no step runs during the swap
        order.append("swap")
    waited = time.monotonic() - t0
    time.sleep(0.02)
    stop.set()
    t.join()
    assert "swap" in order and order[-1] == "step"  # the generation went on after it
    assert waited < 5


def _service(model_dir, inflight: bool) -> RolloutService:
    engine = _engine(model_dir)
    engine.eos_ids = set()
    return RolloutService(engine, RunDir("/nonexistent"), str(model_dir), RequestLimits(256), None,
                          inflight_updates=inflight)


@pytest.mark.parametrize("inflight", [True, False])
def test_a_push_during_a_generation_request(model_dir, inflight):
    """The service's side: in flight, the push returns while the request still generates and the response reports
    its first version, per-token versions for the samples that changed; otherwise the push waits for the request."""
    service = _service(model_dir, inflight)
    engine = service.engine
    new = _other_weights(engine)
    hook = SwapMidway(engine) if inflight else None
    body = {"prompt_token_ids": PROMPTS, "n": 2, "max_new_tokens": 12, "seed": 3}
    res: dict = {}
    started = threading.Event()
    seen = {"generating": False}
    generate, load = engine.generate, engine.load_weights

    def generating(*a, **k):
        seen["generating"] = True
        try:
            return generate(*a, **k)
        finally:
            seen["generating"] = False

    def loading(named):
        seen["loaded_while_generating"] = seen["generating"]
        load(named)

    engine.generate, engine.load_weights = generating, loading

    def request():
        async def go():
            started.set()
            return await service.generate(body)
        res["r"] = asyncio.run(go())

    t = threading.Thread(target=request)
    t.start()
    started.wait(10)
    if hook is not None:
        assert hook.reached.wait(30)
    else:
        while not service.weight_gate.active:
            time.sleep(0.001)
    service._swap(new, 1)
    t.join(60)
    if hook is not None:
        hook.remove()
    r = res["r"]
    outs = protocol.outputs_from_json(r["outputs"])
    if inflight:
        assert seen["loaded_while_generating"]
        assert r["policy_version"] == 0
        assert all(s.versions == [0] * SWAP_AFTER + [1] * 9 for row in outs for s in row)
    else:
        assert not seen["loaded_while_generating"]
        assert r["policy_version"] == 0 and all(s.versions is None for row in outs for s in row)
    assert service.policy_version == engine.weights_version == 1


def test_an_engine_without_inflight_swaps_is_refused_naming_the_key(model_dir):
    engine = _engine(model_dir)
    engine.inflight = False
    with pytest.raises(HpcRlError, match=r"rollout.inflight_updates: the hf engine cannot swap"):
        RolloutService(engine, RunDir("/nonexistent"), str(model_dir), RequestLimits(256), None,
                       inflight_updates=True)


@pytest.mark.parametrize("overrides, match", [
    ({"inflight_updates": True}, r"rollout.inflight_updates: .*set rollout.async_steps >= 1"),
])
def test_config_refuses_inflight_updates_it_cannot_do(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_dict({"model": {"path": "/models/x"}, "rollout": overrides})


# --------------------------------------------------------------------------- the pipeline


def _batch(step: int, version: int) -> RolloutBatch:
    return RolloutBatch(step=step, prompts=[[1]] * 2, responses=[[2]] * 2, loss_masks=[[1]] * 2,
                        rollout_logprobs=[[0.0]] * 2, versions=[version] * 2, truncated=[False] * 2,
                        group_ids=[0, 0], prompt_ids=[7, 7])


class SlowServers:
    """A generation takes gen_s; records which versions were pushed while it ran."""

    def __init__(self, gen_s: float):
        self.gen_s, self.version, self.generating = gen_s, 0, None
        self.pushed_during: list[tuple[int, int]] = []  # (step being generated, version pushed)
        self.started: list[tuple[int, int]] = []  # (step, version when it started)

    def make(self, step):
        self.started.append((step, self.version))
        self.generating = step
        time.sleep(self.gen_s)
        self.generating = None
        return _batch(step, self.started[-1][1])

    def push(self, named, version, probe):
        if self.generating is not None:
            self.pushed_during.append((self.generating, version))
        self.version = version
        return {"version": version}


@pytest.mark.parametrize("inflight", [True, False])
def test_pipeline_pushes_in_flight_and_keeps_the_start_rule(inflight):
    srv = SlowServers(gen_s=0.15)
    n, steps = 1, 5
    pipe = RolloutPipeline(srv.make, srv.push, n, 0, steps, inflight=inflight)
    for s in range(steps):
        pipe.get(s)
        pipe.push([0], s + 1)
    pipe.close()
    # Batch s never starts before version s - n is served, in flight or not.
    assert all(v >= s - n for s, v in srv.started), srv.started
    if inflight:
        assert srv.pushed_during, "no push landed while a batch was generated"
    else:
        assert srv.pushed_during == []  # a push waits for the generation in flight


def test_pipeline_evaluation_of_a_version_runs_before_the_next_push_in_flight():
    srv = SlowServers(gen_s=0.05)
    evals = []

    def evaluate(version):
        evals.append((version, srv.version))
        time.sleep(0.05)
        return {"step": version}

    pipe = RolloutPipeline(srv.make, srv.push, 1, 0, 4, evaluate=evaluate, inflight=True)
    for s in range(4):
        pipe.get(s)
        pipe.push([0], s + 1, evaluate=True)
    pipe.finish_evals()
    pipe.close()
    assert evals == [(v, v) for v in range(1, 5)]  # each evaluation saw the version it evaluates
