"""Partial rollouts and in-flight weight updates (issue 53) on a long-tailed workload, A B A B in the same run.

The toy GRPO job (2 ZeRO-3 ranks, one HF rollout server, rollout.async_steps=1) with responses of up to 128
tokens, the policy held at its initial weights (lr ~0: every side sees the same workload). The random-init policy
ends a response at a random EOS of its small vocabulary, so most responses are short and a few run to the limit:
the tail that decides a step's generation time. Sides:
  async              rollout.async_steps=1 (the reference)
  partial            + rollout.partial (segments of 32 tokens, half as many extra prompts)
  partial+inflight   + rollout.inflight_updates
Per side: steady seconds per step (median after the first two steps), trained samples/s and response tokens/s,
and the ratios against `async` measured in the same rounds; the staleness the speed costs (policy_lag_max, token
lag) is printed beside it.
  python bench/partial.py             # 2 rounds of 10 steps
  python bench/partial.py --quick     # 1 round of 6 steps
Writes bench/results/partial.json; the last line printed is one JSON object with the ratios.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import alternate_sides, bench_job, machine, rounds_args, step_intervals, table, write_result  # noqa: E402

NEW_TOKENS, SEGMENT = 128, 32


def measure(res: dict, samples: int) -> dict:
    rows = res["metrics"]
    steady_rows = rows[2:] if len(rows) > 3 else rows
    step_s = statistics.median(step_intervals(rows)[2:] or step_intervals(rows))
    resp = statistics.median(r["response_len"] for r in steady_rows)
    return {"step_s": round(step_s, 3), "samples_per_s": round(samples / step_s, 2),
            "response_tokens_per_s": round(samples * resp / step_s, 1), "response_len": round(resp, 1),
            "gen_s": round(statistics.median(r["gen_seconds"] for r in steady_rows), 3),
            "policy_lag_max": max(r["policy_lag_max"] for r in rows),
            "token_lag_mean": round(statistics.median(r.get("token_lag_mean", r["policy_lag_mean"])
                                                      for r in steady_rows), 3),
            "carried_groups": statistics.median(r.get("partial_carried_groups", 0) for r in steady_rows)}


def main() -> int:
    args, work = rounds_args(__doc__, steps=10, rounds=2, quick=(6, 1), prefix="hpc-rl-partial-")
    job = bench_job("toy-grpo-cpu", "partial-bench", args.steps)
    # lr ~0: the policy (and so the length distribution) stays the initial one on every side. At the toy's lr the
    # random-init policy drifts to longer responses at a pace that depends on which groups each step trains, so the
    # sides would compare different workloads after a few steps (measured: 68 vs 40 tokens a response by step 10).
    job["trainer"].update(prompts_per_step=16, mini_batch_size=128, lr=1e-12)
    job["rollout"].update(max_new_tokens=NEW_TOKENS, max_model_len=NEW_TOKENS + 32, async_steps=1)
    job["logging"] = {"tensorboard": False}
    samples = job["trainer"]["prompts_per_step"] * job["algorithm"]["group_size"]
    partial = ["rollout.partial=true", f"rollout.partial_tokens={SEGMENT}"]
    sides = {"async": [], "partial": partial, "partial+inflight": [*partial, "rollout.inflight_updates=true"]}
    before = machine()
    runs, med = alternate_sides(job, work, sides, args.rounds, lambda _side, res: measure(res, samples))
    med = {side: {k: round(v, 3) for k, v in m.items()} for side, m in med.items()}
    ref = med["async"]
    ratios = {side: {"samples_per_s": round(m["samples_per_s"] / ref["samples_per_s"], 3),
                     "response_tokens_per_s": round(m["response_tokens_per_s"] / ref["response_tokens_per_s"], 3)}
              for side, m in med.items() if side != "async"}
    print(table(["side", "s/step", "samples/s", "resp tok/s", "resp len", "gen s", "lag max", "token lag", "carried"],
                [[s, m["step_s"], m["samples_per_s"], m["response_tokens_per_s"], m["response_len"], m["gen_s"],
                  m["policy_lag_max"], m["token_lag_mean"], m["carried_groups"]] for s, m in med.items()]))
    summary = {"ratios_vs_async": ratios, "samples_per_step": samples, "new_tokens": NEW_TOKENS,
               "segment_tokens": SEGMENT, "steps": args.steps, "rounds": args.rounds}
    write_result("partial", {"machine_before": before, "machine_after": machine(), "runs": runs, "median": med,
                             "summary": summary})
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
