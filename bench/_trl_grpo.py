"""TRL's GRPOTrainer on CPU, one process: the reference side of bench/vs_trl.py (run as a subprocess so that its
start-up is timed like `hpc-rl run`'s). Writes per-step end times and TRL's logged metrics to --out."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

T_START = time.time()

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=6)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--vllm", action="store_true", help="generate with vLLM (colocate mode) instead of HF generate")
    args = ap.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpc_rl.data.toy import repeat_digit_rows
    from hpc_rl.rewards.toy import repeat_digit

    rows = repeat_digit_rows(2000, args.seed)  # the rows hpc-rl's toy:repeat_digit source uses
    ds = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows])

    def reward(prompts, completions, ground_truth, **_):
        return [repeat_digit(p, c, g) for p, c, g in zip(prompts, completions, ground_truth)]

    step_ends: list[float] = []
    logs: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            step_ends.append(time.time())

        def on_log(self, a, state, control, logs=None, **kw):
            if logs:
                logs_copy = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
                logs_list.append(logs_copy)

    logs_list = logs
    n = args.prompts_per_step * args.group
    cfg = GRPOConfig(
        output_dir=str(Path(args.out).parent / "trl-out"), use_cpu=True, bf16=False, fp16=False,
        per_device_train_batch_size=n, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=args.group, max_completion_length=args.max_new, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, loss_type="bnpo", max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", seed=args.seed, dataloader_num_workers=0, disable_tqdm=True,
        use_vllm=args.vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.05,
        vllm_max_model_length=64, vllm_enable_sleep_mode=False,
    )
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="float32")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                          callbacks=[Timer()])
    t_train = time.time()
    trainer.train()
    out = {"start": T_START, "train_start": t_train, "step_ends": step_ends, "end": time.time(), "logs": logs}
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
