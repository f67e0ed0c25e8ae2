"""vLLM worker extension: in-place weight loading and the collective receive, run inside vLLM's workers.

vLLM injects this class into its worker (`worker_extension_cls`); `AsyncLLM.collective_rpc("hpc_...")`
calls these methods in every worker process (one per tensor-parallel rank), next to the model.
Imports stay inside methods (the class is imported by qualified name in the engine-core process), except
_shorten_cpu_spin's, which runs at import.
"""

from __future__ import annotations

import time

# Seconds a CPU worker keeps polling its request queue after a request before it sleeps on a socket.
CPU_SPIN_SECONDS = 0.01


def _shorten_cpu_spin() -> None:
    """On CPU, let vLLM's worker stop spinning 10 ms after a request instead of vLLM's 1 s.

    vLLM's worker process (CPU always uses one) busy-polls its shared-memory request queue for a second after
    each read; next to trainer ranks on the same cores that second is taken from training (the worker sat
    at 95% CPU while the ranks trained, on 2 cores). Decode steps arrive every few milliseconds, so 10 ms of
    polling keeps generation's latency; after it the worker waits on the queue's socket as vLLM does when idle.
    Installed when vLLM imports this module in the worker; a vLLM without SpinCondition is left alone.
    """
    try:
        from vllm.distributed.device_communicators import shm_broadcast
        from vllm.platforms import current_platform
    except ImportError:
        return
    cls = getattr(shm_broadcast, "SpinCondition", None)
    if cls is None or not current_platform.is_cpu() or getattr(cls, "_hpc_rl_short_spin", False):
        return
    plain_wait = cls.wait

    def wait(self, timeout_ms=None):
        if getattr(self, "busy_loop_s", 0) > CPU_SPIN_SECONDS:
            self.busy_loop_s = CPU_SPIN_SECONDS
        return plain_wait(self, timeout_ms)

    cls.wait = wait
    cls._hpc_rl_short_spin = True


_shorten_cpu_spin()


class HpcRlWorkerExtension:
    """Methods added to vLLM's Worker; `self` is the worker (self.model_runner, self.vllm_config, self.rank)."""

    def hpc_reload_weights(self, path: str) -> float:
        """Load the HF-named tensors of a safetensors file in place (layerwise reload re-runs kernel packing).

        A file (in /dev/shm: RAM) because collective_rpc arguments reach the worker as plain msgpack/pickle
        data: vLLM decodes tensors only in typed messages. Returns seconds.
        """
        import torch
        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        t0 = time.perf_counter()
        model = self.model_runner.get_model()
        pairs = list(load_file(path, device="cpu").items())
        with set_current_vllm_config(self.vllm_config), torch.inference_mode():
            # Plain model.load_weights would leave the CPU GEMM's prepacked copies (oneDNN / sgl) stale:
            # the layerwise reload re-runs process_weights_after_loading per layer.
            initialize_layerwise_reload(model)
            model.load_weights(pairs)
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        return time.perf_counter() - t0

    def hpc_collective_join(self, master_addr: str, master_port: int, world_size: int, base_rank: int,
                            backend: str, timeout_s: float) -> int:
        """Join the trainer's weight-sync group as rank base_rank + this worker's TP rank; returns that rank."""
        from ..wire.collective import join_group

        rank = base_rank + int(self.rank)
        device = "cpu" if backend == "gloo" else f"cuda:{self.device.index or 0}"
        self._hpc_pg = join_group(master_addr, int(master_port), int(world_size), rank, backend, timeout_s,
                                  device=device)
        self._hpc_device = device
        return rank

    def hpc_collective_receive(self, version: int, plan: list) -> float:
        """Receive the header and every bucket of `plan` from rank 0 and load them in place; seconds."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        from ..wire.collective import receive_buckets

        pg = getattr(self, "_hpc_pg", None)
        if pg is None:
            raise RuntimeError("hpc_collective_receive before hpc_collective_join")
        t0 = time.perf_counter()
        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config), torch.inference_mode():
            initialize_layerwise_reload(model)
            # One bucket at a time: memory stays bounded by a bucket, loading overlaps nothing but is simple.
            for named in receive_buckets(pg, plan, int(version), self._hpc_device):
                model.load_weights(named)
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        return time.perf_counter() - t0

    def hpc_collective_close(self) -> None:
        """Leave the weight-sync group."""
        from ..wire.collective import leave_group

        leave_group(getattr(self, "_hpc_pg", None))
        self._hpc_pg = None
