"""The vLLM rollout engine: continuous batching, raw log-probs, in-place weight updates.

AsyncLLM rather than the offline LLM: concurrent requests are batched together in the running engine (the
offline LLM is not thread-safe and batches one call at a time). Its event loop runs on a thread of its own
(`loop`); the rollout server serves HTTP on that same loop, so its endpoints await generate_async /
prompt_top_logprobs_async directly. The synchronous Engine methods (offline use, weight loads from worker
threads) submit coroutines to the loop.

Weights reach vLLM's worker process (not this one) as a safetensors file in /dev/shm whose path goes
through `collective_rpc`, or over the collective group (wire/collective.py); `HpcRlWorkerExtension` loads them
with vLLM's layerwise reload, which also refreshes the CPU GEMM's prepacked weights.

In-flight updates (rollout.inflight_updates) abort and continue: `swapping()` pauses the scheduler with
mode="abort" (vLLM hands back every running request with its tokens and log-probs so far), the weights load, the
prefix cache is reset, and each aborted sample is sent again as its prompt plus those tokens, for the tokens it has
left, with the new weights (which read the prefix afresh: every later token is exactly the new policy's).
vLLM 0.32's other mode, "keep", would continue on KV caches of the old weights. Create engines under `if __name__ == "__main__":` or in
a spawned server process (vLLM spawns its engine core). CPU threads: vLLM binds its worker to the cores
of VLLM_CPU_OMP_THREADS_BIND (default "auto": all cores of a NUMA node but one reserved); set it (e.g.
"0") to leave cores to trainer ranks on the same machine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import threading
import time
import uuid

import torch

from ...errors import ModelError, first_line
from ...models.loading import check_model_dir
from ..wire.protocol import MAX_TOP_K
from ..wire.sampling import SampleOut, SamplingParams, TopLogprobs
from .engine import Engine

log = logging.getLogger("hpc_rl")

WORKER_EXT = "hpc_rl.rollout.server.vllm_worker.HpcRlWorkerExtension"


def _vllm_dtype(name: str) -> str:
    # "auto" would keep a checkpoint's fp32 (tiny models); bf16 is what vLLM's CPU and GPU kernels expect.
    return "bfloat16" if name in (None, "auto") else name


# vLLM allocates the KV cache in blocks; CPU attention backends use blocks of up to 256 tokens, so each
# sequence is budgeted in whole blocks of this size (a small over-estimate for short sequences).
KV_BLOCK_TOKENS = 256
# vLLM's default scheduler limit on concurrent sequences on CPU and most GPUs: more never run at once.
MAX_CONCURRENT_SEQS = 256


def kv_bytes_per_token(model_path: str, dtype: str) -> int:
    """K and V bytes one token takes over all layers: 2 x layers x kv_heads x head_dim x dtype size."""
    import json
    from pathlib import Path

    c = json.loads((Path(model_path) / "config.json").read_text())
    c = c.get("text_config") or c
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    size = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 2)
    return 2 * int(c["num_hidden_layers"]) * kv_heads * head_dim * size


def kv_cache_bytes(cfg, device: str, dtype: str) -> int | None:
    """The KV cache to ask vLLM for (per worker), or None to let gpu_memory_utilization size it.

    On CPU vLLM's fraction is of one NUMA node's RAM and its own baseline memory comes out of it, so whether
    an engine starts depended on the machine's NUMA layout; an absolute size from the job does not."""
    r = cfg.rollout
    if r.kv_cache_bytes is not None:
        return int(r.kv_cache_bytes) or None
    if not str(device).startswith("cpu"):
        return None
    seqs = min(cfg.samples_per_step, MAX_CONCURRENT_SEQS)
    seq_tokens = -(-int(r.max_model_len) // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    per_worker = kv_bytes_per_token(cfg.model.path, dtype) * seqs * seq_tokens // max(1, int(r.tensor_parallel))
    return max(per_worker, 1 << 20)


class VLLMEngine(Engine):
    """vllm.v1 AsyncLLM on its event loop (`loop`); tensor-parallel over cfg.rollout.tensor_parallel devices."""

    reloads_whole_layers = True  # hpc_reload_weights: vLLM's layerwise reload
    inflight = True  # swapping(): abort and continue

    name = "vllm"

    def __init__(self, cfg, device: str = "cpu"):
        r = cfg.rollout
        self.device = device
        self.path = str(check_model_dir(cfg.model.path))
        self.dtype = _vllm_dtype(r.dtype)
        self.seed = int(cfg.seed)
        self.tensor_parallel = int(r.tensor_parallel)
        # A spawned engine core must not inherit a CUDA context; vLLM's CPU build logs less with this set.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm.engine.arg_utils import AsyncEngineArgs

        self.kv_cache_bytes = kv_cache_bytes(cfg, device, self.dtype)
        self._args = AsyncEngineArgs(
            model=self.path, tokenizer=self.path, dtype=self.dtype, seed=self.seed,
            tensor_parallel_size=self.tensor_parallel, gpu_memory_utilization=float(r.gpu_memory_utilization),
            kv_cache_memory_bytes=self.kv_cache_bytes,
            max_model_len=int(r.max_model_len), enforce_eager=bool(r.enforce_eager),
            trust_remote_code=bool(cfg.model.trust_remote_code), logprobs_mode="raw_logprobs",
            max_logprobs=MAX_TOP_K,  # /logprobs with top_k (on-policy distillation's teacher)
            worker_extension_cls=WORKER_EXT, disable_log_stats=True, skip_tokenizer_init=False)
        self._sched: asyncio.Lock | None = None
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hpc-rl-vllm-loop", daemon=True)
        self._thread.start()
        t0 = time.perf_counter()
        try:
            self._llm = self._run(self._start(), timeout=float(r.startup_timeout_s))
        except Exception as e:
            self._stop_loop()
            if self.kv_cache_bytes is not None:
                budget = (f"it asked for a KV cache of {self.kv_cache_bytes / 2**20:.0f} MiB "
                          f"(rollout.kv_cache_bytes={r.kv_cache_bytes if r.kv_cache_bytes is not None else 'null: derived'}); "
                          "free memory on this node, lower rollout.kv_cache_bytes or rollout.max_model_len,")
            else:
                budget = (f"it sized the KV cache from rollout.gpu_memory_utilization={r.gpu_memory_utilization}; "
                          "set rollout.kv_cache_bytes to an absolute size, lower the fraction,")
            raise ModelError(f"rollout: vLLM could not start on {self.path} ({first_line(e)}): {budget} or use "
                             "rollout.engine=hf (the engine core's own error is in the lines above)") from e
        self.startup_seconds = time.perf_counter() - t0
        self._specs: dict | None = None
        self._lock = threading.Lock()  # weight updates are exclusive with each other
        self._swap_held = False  # swapping(): the scheduler is paused (requests aborted) and the lock held
        log.info("vllm engine up in %.1fs (%s, dtype %s, tp %d, kv cache %s)", self.startup_seconds, self.path,
                 self.dtype, self.tensor_parallel,
                 f"{self.kv_cache_bytes / 2**20:.0f} MiB" if self.kv_cache_bytes else "from gpu_memory_utilization")

    # ------------------------------------------------------------------ loop plumbing
    async def _start(self):
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(self._args)

    def _run(self, coro, timeout: float | None = None):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise TimeoutError(f"vLLM engine call did not finish within {timeout}s") from None

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def _sched_lock(self) -> asyncio.Lock:
        # Created on the loop thread (first use): serializes scheduler pause/resume sections.
        if self._sched is None:
            self._sched = asyncio.Lock()
        return self._sched

    async def _many(self, prompts: list[list[int]], sps: list):
        """Admit the whole batch while the scheduler is held, then collect the final outputs; with the weights'
        version they were admitted under (a swap aborts them, so no token of theirs comes from a later one).

        Without the hold, the engine core starts stepping on the first request while the rest are still
        arriving one by one: the batch runs as a staircase of partial batches, more decode steps for the
        same tokens (P4: 0.53-0.75 of bare vllm.LLM on the tiny model; see bench/rollout_bench.py).
        """
        core = self._llm.engine_core
        async with self._sched_lock():
            # engine_core directly: AsyncLLM.pause_generation adds a fixed 20 ms sleep per call.
            await core.pause_scheduler_async(mode="keep", clear_cache=False)
            try:
                qs = [await self._llm.add_request(uuid.uuid4().hex, {"prompt_token_ids": p}, sp)
                      for p, sp in zip(prompts, sps)]
                version = self.weights_version
            finally:
                await core.resume_scheduler_async()
        try:
            return await asyncio.gather(*(_final(q) for q in qs)), version
        except BaseException:
            await self._llm.abort([q.request_id for q in qs], internal=True)
            raise

    # ------------------------------------------------------------------ Engine
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, cancel=None,
                 images=None) -> list[list[SampleOut]]:
        return self._run(self.generate_async(prompt_token_ids, params))

    async def generate_async(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                             cancel=None, images=None) -> list[list[SampleOut]]:
        """`cancel` is not needed here: cancelling the awaiting task aborts the requests in vLLM (_many)."""
        # vLLM seeds the n children of a request with seed + index.
        sps = [_vllm_params(params, params.n, params.max_new_tokens, params.prompt_seed(i))
               for i in range(len(prompt_token_ids))]
        outs, version = await self._many(prompt_token_ids, sps)
        result = [[_sample(c, version) for c in sorted(ro.outputs, key=lambda c: c.index)] for ro in outs]
        while True:  # samples a weight swap aborted continue from their prefix with the new weights
            cut = [(i, j) for i, row in enumerate(result) for j, s in enumerate(row) if s.finish_reason == "abort"]
            if not cut:
                return result
            more, version = await self._many(
                [prompt_token_ids[i] + result[i][j].token_ids for i, j in cut],
                [_vllm_params(params, 1, params.max_new_tokens - len(result[i][j].token_ids),
                              _continued_seed(params.prompt_seed(i), j, len(result[i][j].token_ids))) for i, j in cut])
            for (i, j), ro in zip(cut, more):
                s, c = result[i][j], _sample(ro.outputs[0], version)
                s.token_ids += c.token_ids
                s.logprobs += c.logprobs
                s.versions += c.versions
                s.finish_reason = c.finish_reason

    def prompt_top_logprobs(self, token_ids: list[list[int]], prompt_lens: list[int], k: int,
                            cancel=None, images=None) -> TopLogprobs:
        return self._run(self.prompt_top_logprobs_async(token_ids, prompt_lens, k))

    async def prompt_top_logprobs_async(self, token_ids: list[list[int]], prompt_lens: list[int], k: int,
                                        cancel=None, images=None) -> TopLogprobs:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        # prompt_logprobs=k returns, per position, the k likeliest tokens and the actual one (position 0 is None);
        # k=0 exactly the actual token's log-prob.
        sp = VSP(max_tokens=1, temperature=0.0, prompt_logprobs=k, output_kind=RequestOutputKind.FINAL_ONLY,
                 detokenize=False)
        outs, version = await self._many(token_ids, [sp] * len(token_ids))
        while True:  # a weight swap aborted some: score them again with the new weights
            cut = [i for i, ro in enumerate(outs) if str(ro.outputs[0].finish_reason) == "abort"]
            if not cut:
                break
            again, version = await self._many([token_ids[i] for i in cut], [sp] * len(cut))
            for i, ro in zip(cut, again):
                outs[i] = ro
        res = TopLogprobs([], [], [], version)
        for toks, pl, ro in zip(token_ids, prompt_lens, outs):
            plp = ro.prompt_logprobs[max(pl, 1):len(toks)]
            res.logprobs.append([float(d[t].logprob) for d, t in zip(plp, toks[max(pl, 1):])])
            if k:
                # The actual token is there too when it is not among the k likeliest: the k first by log-prob.
                best = [sorted(d.items(), key=lambda kv: -kv[1].logprob)[:k] for d in plp]
                res.top_ids.append([[int(t) for t, _ in b] for b in best])
                res.top_logprobs.append([[float(v.logprob) for _, v in b] for b in best])
        return res

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF state-dict names and shapes (from the config, on the meta device) with the served dtype."""
        if self._specs is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            conf = AutoConfig.from_pretrained(self.path, trust_remote_code=False)
            with torch.device("meta"):
                m = AutoModelForCausalLM.from_config(conf)
            dt = getattr(torch, self.dtype)
            self._specs = {k: (tuple(v.shape), dt if v.is_floating_point() else v.dtype)
                           for k, v in m.state_dict().items()}
        return self._specs

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        dt = getattr(torch, self.dtype)
        # Cast here: half the bytes of an fp32 trainer copy. clone(): safetensors refuses shared storage.
        named = {n: t.detach().to("cpu", dtype=dt if t.is_floating_point() else t.dtype).contiguous().clone()
                 for n, t in named_tensors}
        # The worker runs in another process on this machine: hand it a file in RAM (/dev/shm) to read.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        fd, path = tempfile.mkstemp(prefix="hpc-rl-weights-", suffix=".safetensors", dir=shm)
        os.close(fd)
        try:
            save_file(named, path)
            del named
            self._update(lambda: self._llm.collective_rpc("hpc_reload_weights", args=(path,)))
        finally:
            os.unlink(path)

    def swapping(self):
        """Abort what runs (generate_async continues it after the swap) and hold the scheduler until the caller has
        loaded the weights and set weights_version."""
        import contextlib

        @contextlib.contextmanager
        def held():
            async def pause():
                await self._sched_lock().acquire()
                try:
                    await self._llm.engine_core.pause_scheduler_async(mode="abort", clear_cache=False)
                except BaseException:
                    self._sched_lock().release()
                    raise

            async def resume():
                try:
                    await self._llm.reset_prefix_cache()
                    await self._llm.engine_core.resume_scheduler_async()
                finally:
                    self._sched_lock().release()

            with self._lock:
                self._run(pause())
                self._swap_held = True
                try:
                    yield
                finally:
                    self._swap_held = False
                    self._run(resume())

        return held()

    def _update(self, rpc_coro_factory):
        """Pause scheduling (in-flight requests finish on the old weights), run the update, reset the cache; inside
        swapping() the scheduler is paused already and the update just runs."""
        if self._swap_held:
            secs = self._run(rpc_coro_factory())
            return max(secs) if isinstance(secs, list) and secs else secs

        async def go():
            async with self._sched_lock():  # no batch admission resumes the scheduler mid-update
                await self._llm.pause_generation(mode="wait", clear_cache=False)
                try:
                    secs = await rpc_coro_factory()
                    await self._llm.reset_prefix_cache()
                    return secs
                finally:
                    await self._llm.resume_generation()

        with self._lock:
            secs = self._run(go())
        return max(secs) if isinstance(secs, list) and secs else secs

    def reset_cache(self) -> None:
        if not self._swap_held:  # (swapping() resets it before resuming)
            self._run(self._llm.reset_prefix_cache())

    # ------------------------------------------------------------------ collective (see collective_receiver.py)
    def collective_workers(self) -> int:
        return self.tensor_parallel

    def collective_join(self, master_addr, master_port, world_size, rank, backend, timeout_s) -> None:
        self._run(self._llm.collective_rpc("hpc_collective_join",
                                           args=(master_addr, master_port, world_size, rank, backend, timeout_s)))

    def collective_receive(self, version: int, plan: list) -> float:
        return self._update(lambda: self._llm.collective_rpc("hpc_collective_receive", args=(int(version), plan)))

    def collective_close(self) -> None:
        self._run(self._llm.collective_rpc("hpc_collective_close"))

    def close(self) -> None:
        llm = getattr(self, "_llm", None)
        self._llm = None
        if llm is not None:
            try:
                llm.shutdown()
            except Exception as e:  # shutting down a dead engine core raises; nothing is left to free
                log.debug("vllm shutdown: %s", e)
        self._stop_loop()


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed: the loop vLLM's own API server runs on, and the rollout server serves HTTP on this
    one; on asyncio's default loop uvicorn answered every keep-alive request ~40 ms late (measured: /health 44 ms
    vs 4 ms; Nagle's algorithm meeting delayed ACKs), which tripled the collective weight sync's latency."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _final(q):
    """The finished RequestOutput from an AsyncLLM request's collector (FINAL_ONLY: usually one item)."""
    while True:
        out = q.get_nowait() or await q.get()
        if out.finished:
            return out


def _vllm_params(params: SamplingParams, n: int, max_tokens: int, seed: int | None):
    """vLLM's SamplingParams for `n` samples of up to `max_tokens` with `params`' sampling: raw log-prob of each
    sampled token, token ids only, the final output alone."""
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    return VSP(n=n, max_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p,
               top_k=params.top_k if params.top_k > 0 else -1, stop_token_ids=list(params.stop_token_ids), seed=seed,
               logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False)


def _sample(c, version: int) -> SampleOut:
    """One vLLM CompletionOutput as a sample, each token tagged with `version`."""
    toks = list(c.token_ids)
    # logprobs=0 returns the sampled token's raw log-prob (logprobs_mode=raw_logprobs) per step.
    lps = [float(c.logprobs[j][t].logprob) for j, t in enumerate(toks)]
    return SampleOut(token_ids=toks, logprobs=lps, finish_reason=_finish(c.finish_reason),
                     versions=[version] * len(toks))


def _continued_seed(seed: int | None, child: int, done: int) -> int | None:
    """The seed of child `child`'s continuation after `done` tokens (seeded requests stay seeded)."""
    return None if seed is None else (seed + child + 1_000_003 * done) % 2**63


def _finish(reason) -> str:
    return {"stop": "stop", "length": "length"}.get(str(reason), str(reason))
