"""Rollout benchmark (not a test): VLLMEngine vs bare vllm.LLM tokens/s, vLLM vs HF engine, weight-sync cost.

Ratios are against references measured in the same run: engine/bare (goal >= 0.9); per transport,
sync seconds / seconds to move the same bytes through that transport alone (goal <= 1.5).
  python bench/rollout_bench.py [--big]     # --big adds a 0.5B-shaped random Qwen2 (slow on CPU)
Writes bench/results/rollout.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpc_rl.config import TinyModelConfig, load_dict  # noqa: E402
from hpc_rl.models.tiny import build_tiny_model  # noqa: E402

CORPUS = [f"{i} + {i + 1} = {2 * i + 1}" for i in range(200)]
BIG = TinyModelConfig(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
                      intermediate_size=4864, max_position_embeddings=512)


def prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(n)]


def timed_generate(fn, reps: int = 3) -> tuple[float, int]:
    fn()  # warm-up (the first CPU batch compiles/allocates)
    best, toks = 1e9, 0
    for _ in range(reps):
        t0 = time.perf_counter()
        toks = fn()
        best = min(best, time.perf_counter() - t0)
    return best, toks


def bench_vllm(cfg, ps, max_new: int) -> dict:
    from hpc_rl.rollout.engine import SamplingParams
    from hpc_rl.rollout.engine_vllm import VLLMEngine

    eng = VLLMEngine(cfg, "cpu")
    sp = SamplingParams(n=1, max_new_tokens=max_new, seed=0)
    secs, toks = timed_generate(lambda: sum(len(s.token_ids) for o in eng.generate(ps, sp) for s in o))
    specs = eng.param_specs()
    named = [(n, torch.randn(s, dtype=torch.float32) * 0.02) for n, (s, _) in specs.items()]
    nbytes = sum(t.numel() * 2 for _, t in named)  # bf16 on the wire
    eng.load_weights(named)  # warm
    t0 = time.perf_counter()
    eng.load_weights(named)
    file_sync = time.perf_counter() - t0
    coll = bench_collective(eng, named)
    eng.close()
    return {"startup_s": eng.startup_seconds, "gen_s": secs, "tokens": toks, "tok_per_s": toks / secs,
            "file_sync_s": file_sync, "file_copy_s": shm_copy_seconds(named), "bytes": nbytes, **coll}


def shm_copy_seconds(named) -> float:
    """The file transport alone: write the bf16 safetensors to /dev/shm and read it back."""
    from safetensors.torch import load_file, save_file

    d = {n: t.to(torch.bfloat16).contiguous() for n, t in named}
    fd, path = tempfile.mkstemp(suffix=".safetensors", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.close(fd)
    try:
        t0 = time.perf_counter()
        save_file(d, path)
        load_file(path)
        return time.perf_counter() - t0
    finally:
        os.unlink(path)


def bench_collective(eng, named) -> dict:
    """Collective sync through the real server routes (in this process) around the engine."""
    import threading

    from hpc_rl.rollout.collective import CollectiveSender, register_server_routes
    from hpc_rl.rollout.server import RolloutService, make_http_server
    from hpc_rl.rundir import RunDir

    service = RolloutService(eng, RunDir(Path(tempfile.mkdtemp(prefix="bench-run-"))), eng.path, 256, None)
    register_server_routes(service)
    httpd = make_http_server(service, "b", "127.0.0.1", 0)
    th = threading.Thread(target=httpd.serve_forever, daemon=True)
    th.start()
    snd = CollectiveSender([f"http://127.0.0.1:{httpd.server_address[1]}"], "b", master_addr="127.0.0.1",
                           timeout_s=600)
    snd.connect()
    snd.broadcast(named, 1)
    times = []
    for v in range(2, 5):
        t0 = time.perf_counter()
        snd.broadcast(named, v)
        times.append(time.perf_counter() - t0)
    snd.close()
    httpd.shutdown()
    httpd.server_close()
    return {"collective_sync_s": min(times), "collective_server_load_s": max(snd.last_seconds.values()),
            "collective_copy_s": raw_gloo_seconds(sum(t.numel() for _, t in named), snd.last_bytes)}


def _raw_recv(port: int, numel: int, dtype: str, reps: int) -> None:
    from hpc_rl.rollout.collective import _bcast, join_group

    pg = join_group("127.0.0.1", port, 2, 1, "gloo", 120)
    for _ in range(reps):
        _bcast(pg, torch.empty(numel, dtype=getattr(torch, dtype))).wait()


def raw_gloo_seconds(numel: int, nbytes: int, reps: int = 4) -> float:
    """The collective transport alone: a gloo broadcast of the same bytes to another process (best of reps-1)."""
    import torch.multiprocessing as mp

    from hpc_rl.rollout.collective import _bcast, join_group

    dtype = "bfloat16" if nbytes == 2 * numel else "float32"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = mp.get_context("spawn").Process(target=_raw_recv, args=(port, numel, dtype, reps))
    p.start()
    pg = join_group("127.0.0.1", port, 2, 0, "gloo", 120)
    buf = torch.zeros(numel, dtype=getattr(torch, dtype))
    _bcast(pg, buf).wait()  # warm
    best = 1e9
    for _ in range(reps - 1):
        t0 = time.perf_counter()
        _bcast(pg, buf).wait()
        best = min(best, time.perf_counter() - t0)
    p.join(timeout=60)
    return best


def bench_bare_llm(path: str, ps, max_new: int, cfg) -> dict:
    from vllm import LLM, SamplingParams

    r = cfg.rollout
    t0 = time.perf_counter()
    llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, max_model_len=r.max_model_len,
              gpu_memory_utilization=r.gpu_memory_utilization, seed=cfg.seed, disable_log_stats=True)
    start = time.perf_counter() - t0
    sp = [SamplingParams(max_tokens=max_new, seed=i, logprobs=0, detokenize=False) for i in range(len(ps))]
    secs, toks = timed_generate(lambda: sum(len(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)))
    del llm
    return {"startup_s": start, "gen_s": secs, "tokens": toks, "tok_per_s": toks / secs}


def bench_hf(cfg, ps, max_new: int) -> dict:
    from hpc_rl.rollout.engine import SamplingParams
    from hpc_rl.rollout.engine_hf import HFEngine

    eng = HFEngine(cfg, "cpu")
    sp = SamplingParams(n=1, max_new_tokens=max_new, seed=0)
    secs, toks = timed_generate(lambda: sum(len(s.token_ids) for o in eng.generate(ps, sp) for s in o), reps=1)
    eng.close()
    return {"gen_s": secs, "tokens": toks, "tok_per_s": toks / secs}


def run_model(label: str, tiny: TinyModelConfig, n_prompts: int, max_new: int, work: Path) -> dict:
    path = build_tiny_model(tiny, CORPUS, work / label)
    cfg = load_dict({"model": {"path": str(path)}, "rollout": {"engine": "vllm"}})
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    ps = prompts(n_prompts, vocab)
    res = {"engine": bench_vllm(cfg, ps, max_new), "bare": bench_bare_llm(str(path), ps, max_new, cfg),
           "hf": bench_hf(cfg, ps, max_new)}
    e = res["engine"]
    res["ratios"] = {
        "engine_over_bare_tok_s": e["tok_per_s"] / res["bare"]["tok_per_s"],
        "vllm_over_hf_tok_s": e["tok_per_s"] / res["hf"]["tok_per_s"],
        "file_sync_over_copy": e["file_sync_s"] / e["file_copy_s"],
        "collective_sync_over_copy": e["collective_sync_s"] / e["collective_copy_s"],
    }
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", action="store_true", help="also a 0.5B-shaped random Qwen2 (slow on CPU)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=64)
    a = ap.parse_args()
    os.environ.setdefault("HPC_RL_ROLLOUT_THREADS", "2")
    work = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    out = {"tiny": run_model("tiny", TinyModelConfig(), a.prompts, a.max_new, work)}
    if a.big:
        out["qwen0.5b-shape"] = run_model("big", BIG, 8, 32, work)
    else:
        out["qwen0.5b-shape"] = "skipped: pass --big (start + warm-up of a 0.5B model exceeds 5 min on 2 CPU cores)"
    res_dir = Path(__file__).resolve().parent / "results"
    res_dir.mkdir(exist_ok=True)
    (res_dir / "rollout.json").write_text(json.dumps(out, indent=1))
    print(f"{'model':<16}{'metric':<34}{'value':>12}")
    for m, r in out.items():
        if isinstance(r, str):
            print(f"{m:<16}{r}")
            continue
        rows = [("vLLM startup s", r["engine"]["startup_s"]), ("VLLMEngine tok/s", r["engine"]["tok_per_s"]),
                ("bare vllm.LLM tok/s", r["bare"]["tok_per_s"]), ("HF engine tok/s", r["hf"]["tok_per_s"]),
                ("file sync s", r["engine"]["file_sync_s"]), ("collective sync s", r["engine"]["collective_sync_s"])]
        rows += [(k, v) for k, v in r["ratios"].items()]
        for k, v in rows:
            print(f"{m:<16}{k:<34}{v:>12.3f}")


if __name__ == "__main__":
    main()
