"""Peak memory of the trainer's log-prob computation on a 151,936-token vocabulary (Qwen2.5's), before and after
issue 14's memory-lean path: the full-sequence fp32 logits of the previous `policy_forward` (kept below as the
reference) against today's `hpc_rl.train.experience.policy_forward` (response logits only, chunked log-softmax,
chunks recomputed in backward).

Each measurement is a fresh process (a random-init Qwen2 with a tiny hidden size, so that the vocabulary
dominates): peak RSS during the computation minus RSS before it. Both sides run with MALLOC_MMAP_THRESHOLD_=65536,
so that freed tensors go back to the OS at once and peak RSS follows the live tensors, not glibc's heap
retention (without it the same run reads 75-480 MiB from one process to the next). Sides alternate A B A B.
  python bench/logprob_memory.py            # no-grad forward and forward+backward with entropy, 2 reps
Writes bench/results/logprob_memory.json; the last line printed is one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, machine, table, write_result  # noqa: E402

VOCAB = 151_936


def reference_policy_forward(model, batch, temperature: float = 1.0, with_entropy: bool = False):
    """hpc-rl's policy_forward before issue 14: logits of every position, sliced, then whole-tensor fp32 math."""
    from hpc_rl.algos.losses import entropy_from_logits, logprobs_from_logits

    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                use_cache=False)
    P = batch.prompt_len
    logits = out.logits[:, P - 1:-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = logprobs_from_logits(logits, batch.responses)
    ent = entropy_from_logits(logits) if with_entropy else None
    return logp, ent


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(side: str, mode: str, batch_size: int, prompt_len: int, response_len: int, dtype: str) -> dict:
    """In this process: peak extra bytes of one log-prob computation (mode: forward | backward)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hpc_rl.train.experience import pack, policy_forward

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=64, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (prompt_len,), generator=g).tolist() for _ in range(batch_size)]
    responses = [torch.randint(3, VOCAB, (response_len - (i % 4) * 8,), generator=g).tolist() for i in range(batch_size)]
    batch = pack(prompts, responses, pad_id=0)
    fn = reference_policy_forward if side == "before" else policy_forward
    before = _rss_bytes()
    if mode == "forward":
        with torch.no_grad():
            logp, _ = fn(model, batch)
    else:
        logp, ent = fn(model, batch, 0.9, with_entropy=True)
        (logp.sum() + 0.01 * ent.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_extra_bytes": max(0, peak - before), "logp_sum": float(logp.detach().double().sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=192)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--child", nargs=2, metavar=("SIDE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = (args.batch, args.prompt_len, args.response_len, args.dtype)
    if args.child:
        print(json.dumps(measure(*args.child, *shape)))
        return
    result = {"machine_before": machine(), "vocab": VOCAB, "batch": args.batch, "prompt_len": args.prompt_len,
              "response_len": args.response_len, "dtype": args.dtype, "runs": {}}
    for mode in ("forward", "backward"):
        runs = {"before": [], "after": []}
        for _ in range(args.reps):
            for side in ("before", "after"):  # A B A B
                cmd = [sys.executable, __file__, "--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
                       "--response-len", str(args.response_len), "--dtype", args.dtype, "--child", side, mode]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, timeout=900,
                                     env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
                runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        result["runs"][mode] = runs
    result["machine_after"] = machine()
    rows, ratios = [], {}
    for mode, runs in result["runs"].items():
        b = statistics.median(r["peak_extra_bytes"] for r in runs["before"])
        a = statistics.median(r["peak_extra_bytes"] for r in runs["after"])
        same = abs(runs["before"][0]["logp_sum"] - runs["after"][0]["logp_sum"]) <= 1e-3 * abs(runs["before"][0]["logp_sum"])
        ratios[mode] = a / b
        rows.append([mode, f"{b / 2**20:.0f}", f"{a / 2**20:.0f}", f"{a / b:.3f}", "yes" if same else "NO"])
    result["ratios"] = ratios
    path = write_result("logprob_memory", result)
    print(table(["computation", "before MiB", "after MiB", "after / before", "same log-probs"], rows))
    m0, m1 = result["machine_before"], result["machine_after"]
    print(f"vocab {VOCAB}, batch {args.batch} x (prompt {args.prompt_len} + response <= {args.response_len}), "
          f"{args.dtype}, median of {args.reps}; load avg {m0['load_avg'][0]:.2f} -> {m1['load_avg'][0]:.2f}; "
          f"goal after/before <= 0.25; wrote {path.relative_to(REPO)}")
    print(json.dumps({"ratio": ratios, "goal": 0.25}))


if __name__ == "__main__":
    main()
