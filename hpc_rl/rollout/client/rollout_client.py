"""RolloutClient: trainer rank 0's view of a run's rollout servers (or its reward nodes' servers): membership
(pool.py), requests split and routed across them (routing.py), and weight pushes (weight_push.py, one module per
transport under transports/). The API it speaks is hpc_rl.rollout.wire.protocol's."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from ...errors import RolloutError
from ...rundir import RunDir
from ..wire import protocol
from ..wire.sampling import SampleOut, SamplingParams, TopLogprobs
from .pool import ServerPool
from .routing import Router, bounded, split_contiguous, split_weighted
from .weight_push import WeightPush

log = logging.getLogger("hpc_rl")

# Weight of the newest measurement in a server's throughput estimate (tokens/s of its generate requests).
THROUGHPUT_EWMA = 0.5


@dataclass
class GenerateResult:
    outputs: list[list[SampleOut]]
    policy_versions: list[int]
    tokens_per_s: float
    seconds: float
    server_tokens: dict = field(default_factory=dict)  # server index -> tokens it generated for this call


class RolloutClient(ServerPool):
    """Talks to every server of one kind of a run: generation, log-probs, reward-model scores, weight pushes."""

    def __init__(self, run: RunDir, token: str, timeout_s: float = 300.0, retries: int = 2,
                 weight_sync: str = "auto", trainer_device: str = "cpu", kind: str = "rollout",
                 max_samples: int = 1024):
        super().__init__(run, token, kind)
        self.max_samples = max_samples  # per request (rollout.max_samples_per_request): larger work is split
        self.router = Router(self, timeout_s, retries)
        self.weights = WeightPush(self, self.router, weight_sync, trainer_device)
        self._served_tokens: dict[int, int] = {}  # server index -> generated tokens since take_server_tokens()

    @classmethod
    def from_run_dir(cls, run: RunDir, cfg, kind: str = "rollout") -> RolloutClient:
        """A client for the run's servers of `kind`, with timeouts/retries/weight transport from cfg.rollout."""
        r = cfg.rollout
        dev = cfg.trainer.device
        if dev == "auto":
            import torch

            dev = "cuda" if torch.cuda.is_available() else "cpu"
        client = cls(run, run.read_token(), timeout_s=r.request_timeout_s, retries=r.retries,
                     weight_sync=r.weight_sync, trainer_device=dev, kind=kind, max_samples=r.max_samples_per_request)
        client.layout = cfg.server_layout(kind)
        return client

    @property
    def weight_sync(self) -> str:
        """rollout.weight_sync (a change takes effect at the next push)."""
        return self.weights.weight_sync

    @weight_sync.setter
    def weight_sync(self, value: str) -> None:
        self.weights.weight_sync = value

    def take_server_tokens(self) -> dict[int, int]:
        """Tokens each server generated since the last call (server index -> tokens)."""
        out, self._served_tokens = self._served_tokens, {}
        return out

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, step: int,
                 images: list[list[bytes]] | None = None) -> GenerateResult:
        """Samples for every prompt, split across the servers; RolloutError names the server, step and cause.
        `images[i]`: prompt i's encoded images (a vision-language policy), sent beside its ids."""
        t0 = time.perf_counter()
        if not prompt_token_ids:
            return GenerateResult([], [], 0.0, 0.0)
        live = self.healthy()
        if self.elastic() and len([s for s in live if s.verified]) > 1:
            live = [s for s in live if s.verified]
            # Servers of rollout jobs may be faster or slower: each gets a share by its measured throughput (the
            # unmeasured one the mean of the others'). Chunk boundaries then follow timing, so the samples of such a
            # run are not bit-reproducible; a run of only its own servers keeps equal, fixed chunks.
            measured = [s.tokens_per_s for s in live if s.tokens_per_s > 0]
            mean = sum(measured) / len(measured) if measured else 1.0
            ranges = split_weighted(len(prompt_token_ids), [s.tokens_per_s or mean for s in live])
        else:
            ranges = split_contiguous(len(prompt_token_ids), self.router.n_chunks())
        ranges, owners = bounded(ranges, params.n, self.max_samples)
        bodies = []
        for a, b in ranges:
            # Each prompt keeps its own seed whichever chunk and server it lands in.
            seeds = [params.prompt_seed(i) for i in range(a, b)]
            p = SamplingParams(n=params.n, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                               top_p=params.top_p, top_k=params.top_k, stop_token_ids=list(params.stop_token_ids),
                               seeds=None if None in seeds else seeds)
            bodies.append(protocol.params_to_json(prompt_token_ids[a:b], p, None if images is None else images[a:b]))
        served_by: list = [None] * len(bodies)
        results = self.router.run_chunks("/generate", bodies, f"generate at step {step}", live, served_by, owners)
        outputs: list[list[SampleOut]] = []
        versions: list[int] = []
        per_server: dict[int, int] = {}
        for (a, b), res, by in zip(ranges, results, served_by):
            outs = protocol.outputs_from_json(res["outputs"])
            if len(outs) != b - a:
                raise RolloutError(f"generate at step {step}: a server returned {len(outs)} outputs for "
                                   f"{b - a} prompts; server and client versions differ")
            outputs.extend(outs)
            versions.extend([int(res["policy_version"])] * (b - a))
            ntok = sum(len(s.token_ids) for row in outs for s in row)
            srv, seconds = by
            per_server[srv.index] = per_server.get(srv.index, 0) + ntok
            self._served_tokens[srv.index] = self._served_tokens.get(srv.index, 0) + ntok
            if seconds > 0 and ntok:
                rate = ntok / seconds
                srv.tokens_per_s = rate if srv.tokens_per_s <= 0 else \
                    THROUGHPUT_EWMA * rate + (1 - THROUGHPUT_EWMA) * srv.tokens_per_s
        dt = time.perf_counter() - t0
        ntok = sum(len(s.token_ids) for row in outputs for s in row)
        return GenerateResult(outputs, versions, ntok / dt if dt > 0 else 0.0, dt, per_server)

    def logprobs(self, token_ids: list[list[int]], prompt_lens: list[int],
                 images: list[list[bytes]] | None = None) -> list[list[float]]:
        """Raw log-probs of token_ids[i][prompt_lens[i]:] under the served policy (`images[i]`: row i's prompt
        images, a vision-language policy)."""
        return [row for res in self._logprobs(token_ids, prompt_lens, 0, images) for row in res["logprobs"]]

    def top_logprobs(self, token_ids: list[list[int]], prompt_lens: list[int], k: int,
                     images: list[list[bytes]] | None = None) -> TopLogprobs:
        """logprobs, and at each of those positions the served model's k likeliest tokens and their raw log-probs."""
        out = TopLogprobs([], [], [])
        for res in self._logprobs(token_ids, prompt_lens, k, images):
            out.logprobs += res["logprobs"]
            out.top_ids += res["top_ids"]
            out.top_logprobs += res["top_logprobs"]
        return out

    def _logprobs(self, token_ids: list[list[int]], prompt_lens: list[int], k: int,
                  images: list[list[bytes]] | None = None) -> list[dict]:
        if not token_ids:
            return []
        ranges, owners = bounded(split_contiguous(len(token_ids), self.router.n_chunks()), 1, self.max_samples)
        bodies = [{"token_ids": token_ids[a:b], "prompt_lens": list(prompt_lens[a:b]), **({"top_k": k} if k else {}),
                   **({"images": protocol.images_to_json(images[a:b])} if images is not None else {})}
                  for a, b in ranges]
        return self.router.run_chunks("/logprobs", bodies, "logprobs", owners=owners)

    def score(self, token_ids: list[list[int]]) -> list[float]:
        """Raw reward-model logits of the rows (reward.model.placement: server), split across the servers."""
        if not token_ids:
            return []
        ranges = split_contiguous(len(token_ids), self.router.n_chunks())
        results = self.router.run_chunks("/v1/score", [{"token_ids": token_ids[a:b]} for a, b in ranges], "reward model score")
        out = [float(x) for res in results for x in res["logits"]]
        if len(out) != len(token_ids):
            raise RolloutError(f"reward model score: the servers returned {len(out)} scores for {len(token_ids)} "
                               "samples; server and client versions differ")
        return out


    def push_weights(self, named_tensors: Iterable, version: int) -> dict:
        """Send the actor's HF state dict (or adapters) to every healthy server; {"seconds", "bytes", "transport"}."""
        return self.weights.push(named_tensors, version)

    def close(self) -> None:
        """Leave the weight-sync group (servers are told to leave too) and close the HTTP sessions."""
        self.weights.close()
        for s in self.servers.values():
            s.session.close()


__all__ = ["RolloutClient", "GenerateResult", "SamplingParams", "SampleOut", "split_contiguous", "split_weighted"]
