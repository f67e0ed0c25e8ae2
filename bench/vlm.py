"""Step time of the vision-language toy (jobs/toy-vlm-cpu.yaml) against the text toy of the same language model
(jobs/toy-grpo-cpu.yaml: the same 2-layer, 128-wide Qwen2 body, group size, prompts, response length, ranks and
rollout server), A B A B, and where the extra time goes: the step's phases from metrics.jsonl (generation on the
server, the learner's no-grad forwards, the update, the weight sync) as ratios VLM / text, and the cost of the
image work alone measured in this process (decoding and processing one step's images; the vision tower's forward).

The VLM's prompts are longer by its image tokens (4 per 56x56 picture plus the vision start/end tokens), so part of
the ratio is more tokens, not vision code: the table prints both sides' prompt lengths.
  python bench/vlm.py                 # 20 steps, 2 rounds
  python bench/vlm.py --quick         # 6 steps, 1 round
Writes bench/results/vlm.json; the last line printed is one JSON object with the ratios.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import bench_job, machine, rounds_args, run_hpc_rl, steady, table, write_result  # noqa: E402

PHASES = ("gen_seconds", "forward_seconds", "update_seconds", "sync_seconds")


def jobs(steps: int) -> dict:
    """Both sides' job specs: the toys as they ship, cut to `steps` steps, the sync check off on both."""
    out = {}
    for side, base in (("text", "toy-grpo-cpu"), ("vlm", "toy-vlm-cpu")):
        job = bench_job(base, f"vlm-bench-{side}", steps)
        job["trainer"]["check_sync_every"] = 0
        out[side] = job
    return out


def measure(side: str, res: dict) -> dict:
    rows = res["metrics"][1:]  # the first step warms up
    out = {"step_s": steady(res["step_s"])}
    for k in PHASES:
        out[k] = statistics.median(r[k] for r in rows)
    out["prompt_tokens"] = prompt_tokens(res["run_dir"])
    return out


def prompt_tokens(run_dir: str) -> float:
    """Mean prompt length in tokens (image tokens included) of the run's dataset, with the run's own model."""
    from hpc_rl import config
    from hpc_rl.data.datasets import PromptDataset
    from hpc_rl.models import load_tokenizer
    from hpc_rl.models.vision import VisionSpec

    cfg = config.load(Path(run_dir) / "job.yaml", ["data.toy_size=200"])
    tok = load_tokenizer(cfg.model.path)
    ds = PromptDataset(cfg.data, tok, cfg.seed, vision=VisionSpec.for_job(cfg, tok))
    return statistics.mean(len(t) for t in ds.token_ids)


def image_work(samples: int = 256) -> dict:
    """In this process: seconds to decode and process one step's pictures (`samples` of them, as the learner does
    once per group: samples / group size), and one forward of the toy's vision tower over them."""
    import tempfile

    import torch

    from hpc_rl.config import TinyModelConfig
    from hpc_rl.data.toy import colour_digit_corpus, colour_image
    from hpc_rl.models import load_causal_lm, load_tokenizer
    from hpc_rl.models.tiny import build_tiny_model
    from hpc_rl.models.vision import VisionSpec

    torch.set_num_threads(1)
    tiny = bench_job("toy-vlm-cpu", "x", 1)["model"]["tiny"]
    folder = build_tiny_model(TinyModelConfig(**tiny), colour_digit_corpus(), Path(tempfile.mkdtemp()) / "m")
    spec = VisionSpec.of(folder, load_tokenizer(folder))
    images = [colour_image(i % 10, jitter=12, seed=i) for i in range(samples // 8)]
    t0 = time.perf_counter()
    pv, grid = spec.pixels(images)
    process_s = time.perf_counter() - t0
    model = load_causal_lm(folder).eval()
    with torch.no_grad():
        model.model.visual(pv, grid_thw=grid)
        t0 = time.perf_counter()
        model.model.visual(pv, grid_thw=grid)
    return {"pictures": len(images), "process_s": process_s, "tower_forward_s": time.perf_counter() - t0}


def main() -> None:
    args, work = rounds_args(__doc__, steps=20, rounds=2, quick=(6, 1), prefix="hpc-rl-vlm-")
    specs = jobs(args.steps)
    runs: dict[str, list[dict]] = {"text": [], "vlm": []}
    for r in range(args.rounds):  # A B A B (each side has its own job, not overrides of one)
        for side, job in specs.items():
            runs[side].append(measure(side, run_hpc_rl(job, work, f"{side}-{r}")))
            print(f"round {r} {side}: {runs[side][-1]}", flush=True)
    med = {side: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for side, rs in runs.items()}
    ratios = {k: med["vlm"][k] / med["text"][k] if med["text"][k] else None for k in ("step_s", *PHASES)}
    work_s = image_work()
    print(table(["side", "s/step", *PHASES, "prompt tokens"],
                [[s, f"{m['step_s']:.3f}", *(f"{m[k]:.3f}" for k in PHASES), f"{m['prompt_tokens']:.1f}"]
                 for s, m in med.items()]))
    print(f"image work of one step ({work_s['pictures']} pictures): processing {work_s['process_s']:.4f}s, vision "
          f"tower forward {work_s['tower_forward_s']:.4f}s")
    result = {"machine": machine(), "steps": args.steps, "rounds": args.rounds, "runs": runs, "median": med,
              "ratio_vlm_over_text": ratios, "image_work": work_s}
    path = write_result("vlm", result)
    print(f"wrote {path}")
    print(json.dumps({"ratio_vlm_over_text": ratios, "load_avg": result["machine"]["load_avg"]}))


if __name__ == "__main__":
    main()
