"""What an OpenAI-SDK agent costs against native generation: the copy toy (jobs/toy-grpo-cpu.yaml, 2 ZeRO-3 ranks and
one HF rollout server) two ways, sides alternating (A B A B):

  native   the orchestrator's own path: one generation request of the step's 256 samples
  agent    hpc_rl.rollout.environments.toy_agents:copy_agent, one /v1/completions call per episode through the
           openai SDK and the run's agent front (256 episodes at once, gathered into waves)

Per side: median step seconds after the first, the generation phase's seconds and samples/s (256 / step seconds);
and the agent path's cost per call in ms (the step time it adds, over the step's 256 calls).
The goal (issue: the OpenAI path must not cost more than 20%) is agent samples/s >= 0.8 x native. On this toy a
step's generation is ~0.1 s for 256 samples, so the SDK's CPU per call weighs far more than it would beside a real
model's generation; the bench also measures the SDK alone against canned in-process answers (sdk_alone_ms_per_call):
the floor of an agent call's cost, whatever hpc-rl's front does.
  python bench/agent_overhead.py           # 12 steps, 2 rounds
  python bench/agent_overhead.py --quick   # 4 steps, 1 round
Writes bench/results/agent_overhead.json; the last line printed is one JSON object with the ratio.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import alternate_sides, bench_job, machine, rounds_args, steady, table, write_result  # noqa: E402

SIDES = {"native": [],
         "agent": ["rollout.agent=hpc_rl.rollout.environments.toy_agents:copy_agent", "rollout.agent_concurrency=256",
                   "reward.function=null"]}


def sdk_ms_per_call(calls: int = 256, rounds: int = 3) -> float:
    """The openai SDK's own CPU per call, through the clients hpc-rl gives agents (agent_clients: the in-process
    httpx client, one client copy per episode) but with a front that answers a canned completion at once (no
    recording, no server, no engine): `calls` concurrent completions, the median over `rounds` after a warm-up
    round, in ms per call. The floor of what an agent's call can cost here, whatever the front does."""
    import asyncio
    import time

    from hpc_rl.orchestrator.agent_clients import EpisodeClients, in_process_client

    body = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "text": " 3 4", "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}

    class CannedFront:
        def request(self, method, path, auth, raw):
            return 200, body, None

    async def measure() -> list[float]:
        out = []
        async with in_process_client(CannedFront(), 60) as http:
            clients = EpisodeClients(http, "k")
            for _ in range(rounds + 1):
                t0 = time.perf_counter()
                episode = [clients(f"http://front/e/{i}/v1") for i in range(calls)]
                await asyncio.gather(*[c.completions.create(model="m", prompt="copy 1 2 :", max_tokens=6)
                                       for c in episode])
                out.append((time.perf_counter() - t0) / calls * 1000)
        return out[1:]

    return statistics.median(asyncio.run(measure()))


def main() -> None:
    args, work = rounds_args(__doc__, steps=12, rounds=2, quick=(4, 1), prefix="agent-overhead-bench-")
    job = bench_job("toy-grpo-cpu", "agent-overhead-bench", args.steps)
    samples = job["trainer"]["prompts_per_step"] * job["algorithm"]["group_size"]
    load_before = machine()["load_avg"]

    def measure(side: str, res: dict) -> dict:
        m = res["metrics"][1:] or res["metrics"]
        step_s = steady(res["step_s"])
        return {"step_s": step_s, "gen_s": statistics.median(x["gen_seconds"] for x in m),
                "samples_per_s": samples / step_s}

    runs, med = alternate_sides(job, work, SIDES, args.rounds, measure)
    ratio = med["agent"]["samples_per_s"] / med["native"]["samples_per_s"]
    # What an episode's call costs on top of native generation: a constant per call, so its share of a step shrinks
    # as generation gets longer (a real model's samples take far longer than this toy's ~0.3 ms).
    per_call_ms = (med["agent"]["step_s"] - med["native"]["step_s"]) / samples * 1000
    sdk_ms = sdk_ms_per_call(samples)
    rows = [[side, f"{v['step_s']:.2f}", f"{v['gen_s']:.2f}", f"{v['samples_per_s']:.1f}"] for side, v in med.items()]
    print(table(["side", "s/step", "generation s", "samples/s"], rows))
    result = {"machine": machine(), "load_avg_before": load_before, "steps": args.steps, "rounds": args.rounds,
              "sides": med, "runs": runs, "ratio_agent_vs_native_samples_per_s": ratio, "goal": 0.8,
              "agent_overhead_ms_per_call": per_call_ms, "sdk_alone_ms_per_call": sdk_ms,
              "ratio_if_the_sdk_cost_nothing": samples / (med["agent"]["step_s"] - sdk_ms * samples / 1000)
              / med["native"]["samples_per_s"]}
    write_result("agent_overhead", result)
    print(f"the agent path adds {per_call_ms:.2f} ms per call; the openai SDK alone (canned in-process answers) "
          f"costs {sdk_ms:.2f} ms per call")
    print(json.dumps({"agent_vs_native_samples_per_s": round(ratio, 3), "goal": 0.8,
                      "agent_overhead_ms_per_call": round(per_call_ms, 2), "sdk_alone_ms_per_call": round(sdk_ms, 2)}))


if __name__ == "__main__":
    main()
