"""The HF fallback engine: a transformers causal LM with a small batched sampling loop.

Own loop rather than `model.generate`: a model folder's generation_config (e.g. Qwen's
repetition_penalty, a default top_k=50) would silently change the sampling distribution, and
`generate` cannot take a torch.Generator; here every sampled token comes from exactly
temperature/top-k/top-p and a per-request generator, and its raw log-prob is logged alongside.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from ...errors import ModelError
from ...models import load_causal_lm
from ...models.vision import RowPixels, VisionSpec, is_vision_model, mrope_positions
from ..wire.protocol import BadRequest, PolicyNotFinite
from ..wire.sampling import SampleOut, SamplingParams, TopLogprobs
from .engine import Cancelled, Engine, FairLock, StepGate

log = logging.getLogger("hpc_rl")

THREADS_ENV = "HPC_RL_ROLLOUT_THREADS"


def _threads(device: str) -> int | None:
    """CPU threads for the engine: $HPC_RL_ROLLOUT_THREADS (the launcher sets it: launch.cpu_threads), else 1 on
    CPU (a server started by hand shares the cores)."""
    raw = os.environ.get(THREADS_ENV)
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ModelError(f"{THREADS_ENV}={raw!r} is not a positive integer; set it to the CPU threads "
                             "the rollout engine may use, e.g. 2")
        return n
    return 1 if device == "cpu" else None


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k (k <= 0 off) and top-p (1.0 off) exclude; rows of (B, V) float logits."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class HFEngine(Engine):
    """transformers AutoModelForCausalLM in eval mode; left-padded batches with a KV cache."""

    name = "hf"
    inflight = True  # swapping(): between decoding steps
    drop_finished = True  # finished samples leave the decoding batch (False: every row runs to the last step)

    def __init__(self, cfg, device: str = "cpu"):
        if not cfg.model.path:
            raise ModelError("model.path: the rollout server needs an HF model folder; set model.path "
                             "(hpc-rl run/submit fill it in for model.tiny)")
        self.device = torch.device(device)
        n = _threads(self.device.type)
        if n is not None:
            torch.set_num_threads(n)
        dtype = cfg.rollout.dtype
        if dtype == "auto":
            dtype = "float32" if self.device.type == "cpu" else "bfloat16"
        attn = cfg.model.attn_implementation
        if attn == "flash_attention_2" and self.device.type == "cpu":
            attn = "sdpa"  # flash-attn has no CPU kernels
        self.model = load_causal_lm(cfg.model.path, dtype=dtype, attn_implementation=attn,
                                    trust_remote_code=cfg.model.trust_remote_code)
        self.model.to(self.device).eval()
        self.model.requires_grad_(False)
        gc = self.model.generation_config
        eos = gc.eos_token_id if gc.eos_token_id is not None else self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        pad = gc.pad_token_id if gc.pad_token_id is not None else self.model.config.pad_token_id
        self.pad_id = int(pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0))
        self._params = dict(self.model.state_dict())
        # A vision-language model: prompts' images become pixel_values with the job's processor settings.
        self.vision = None
        if is_vision_model(cfg.model.path):
            from ...models import load_tokenizer

            self.vision = VisionSpec.for_job(cfg, load_tokenizer(cfg.model.path, cfg.model.trust_remote_code))
            self.takes_images = True
            self._no_sample = torch.tensor([self.vision.image_pad_id], device=self.device)
        # One computation at a time (concurrent ones would split the engine's threads between them), taken in turns.
        self._turns = FairLock()
        # Weight loads under running generations (rollout.inflight_updates) wait for one decoding step, not a chunk.
        self._steps = StepGate()
        self.batch_samples = int(cfg.rollout.hf_batch_samples)
        log.info("hf engine: %s on %s, dtype %s, attention %s, threads %s", cfg.model.path, self.device,
                 dtype, attn, torch.get_num_threads())

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 cancel: threading.Event | None = None, images: list[list[bytes]] | None = None
                 ) -> list[list[SampleOut]]:
        """Samples in chunks of rollout.hf_batch_samples rows, each chunk one turn of the fair lock: a request that
        arrives while a large one runs is served after the chunk in progress, not after the whole request."""
        n = params.n
        self._check_images(prompt_token_ids, images)
        rows = [p for p in prompt_token_ids for _ in range(n)]
        row_images = [imgs for imgs in (images or [[]] * len(prompt_token_ids)) for _ in range(n)]
        gens = self._generators(len(prompt_token_ids), params)
        samples: list[SampleOut] = []
        for start in range(0, len(rows), self.batch_samples):
            end = start + self.batch_samples
            with self._turns.turn(cancel):
                samples += self._generate(rows[start:end], gens[start:end], params, cancel, row_images[start:end])
        return [samples[i:i + n] for i in range(0, len(samples), n)]

    def _check_images(self, prompts: list[list[int]], images: list[list[bytes]] | None, field: str = "images"):
        """BadRequest naming the prompt whose images do not decode or do not match its image tokens."""
        if not images or not any(images):
            return
        if self.vision is None:
            raise BadRequest(f"{field}: this engine's model takes no images")
        pad = self.vision.image_pad_id
        for i, (ids, imgs) in enumerate(zip(prompts, images)):
            try:
                want = sum(self.vision.tokens_per_image(imgs))
            except Exception as e:  # PIL's errors for bytes that are not an image
                raise BadRequest(f"{field}[{i}]: an image does not decode ({type(e).__name__}); send PNG/JPEG/WebP "
                                 "bytes") from None
            if ids.count(pad) != want:
                raise BadRequest(f"{field}[{i}]: the prompt holds {ids.count(pad)} image pad token(s) but its "
                                 f"{len(imgs)} image(s) need {want}; expand each image's pad to its token count")

    def _positions(self, ids: torch.Tensor, mask: torch.Tensor, vis: dict) -> torch.Tensor:
        """Position ids that count real tokens only ([B, L]; a vision model's images: [3, B, L] M-RoPE)."""
        if vis:
            return mrope_positions(self.model, ids, mask, vis["image_grid_thw"], self.vision.image_pad_id)
        return (mask.cumsum(-1) - 1).clamp(min=0)

    def _vision(self, row_images: list[list[bytes]] | None) -> dict:
        """The forward kwargs of the rows' images: the vision tower runs once per distinct picture (a prompt's n
        samples share it), as in the learner's forwards."""
        if not row_images or not any(row_images):
            return {}
        return RowPixels.of(self.vision, row_images).to(self.device).inputs(self.model)

    @torch.inference_mode()
    def _generate(self, rows: list[list[int]], gens: list[torch.Generator], params: SamplingParams,
                  cancel: threading.Event | None, row_images: list[list[bytes]] | None = None) -> list[SampleOut]:
        stop_ids = torch.tensor(sorted(self.eos_ids | set(params.stop_token_ids)), dtype=torch.long,
                                device=self.device)
        b = len(rows)
        width = max(len(r) for r in rows)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        vis = self._vision(row_images)
        pos = self._positions(ids, mask, vis)
        with self._steps.step():
            version = self.weights_version  # of the weights that computed `logits` (and the KV cache)
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **vis)
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        last_pos = pos[..., -1]
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        # The rows still generating (`live`): a finished sample leaves the batch with its KV cache rows, so each
        # decoding step computes the running samples only (with responses of varied length, a third of the work
        # or more). Not with images (their vision inputs are per picture, not per row), nor with a cache whose
        # layers cannot drop rows.
        compact = self.drop_finished and not vis and hasattr(past, "batch_select_indices") and all(
            hasattr(layer, "batch_select_indices") for layer in getattr(past, "layers", []))
        live = torch.arange(b, device=self.device)
        live_gens = gens
        toks, lps, versions = [], [], []
        for step in range(params.max_new_tokens):
            if cancel is not None and cancel.is_set():  # the client went away: stop between decode steps
                raise Cancelled("the client went away")
            logits = logits.float()
            if not bool(torch.isfinite(logits).all()):
                raise PolicyNotFinite(f"the model's logits are not finite at generated token {step + 1}")
            raw = torch.log_softmax(logits, dim=-1)
            if self.vision is not None:
                # The image pad's embedding means "an image's features go here": a response that held one would
                # not even run through the model again, so it is never sampled (its raw log-prob stays reported).
                logits = logits.index_fill(-1, self._no_sample, float("-inf"))
            live_done = done[live]
            if params.greedy:
                picked = logits.argmax(dim=-1)
            else:
                probs = torch.softmax(filter_logits(logits / params.temperature, params.top_k, params.top_p), -1)
                picked = self._sample(probs, live_gens, live_done)
            picked = torch.where(live_done, self.pad_id, picked)
            tok = torch.full((b,), self.pad_id, dtype=torch.long, device=self.device)
            tok[live] = picked
            lp = torch.zeros(b, dtype=raw.dtype, device=self.device)
            lp[live] = raw.gather(-1, picked[:, None]).squeeze(-1)
            toks.append(tok)
            lps.append(lp)
            versions.append(version)
            done = done | torch.isin(tok, stop_ids)
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            if compact and bool(done[live].any()):
                keep = (~done[live]).nonzero().flatten()
                past.batch_select_indices(keep)
                live, mask, last_pos = live[keep], mask[keep], last_pos[..., keep]
                live_gens = [live_gens[i] for i in keep.tolist()]
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=self.device)], dim=1)
            last_pos = last_pos + 1
            with self._steps.step():
                if self.weights_version != version:
                    # New weights arrived in flight: the cache holds the old weights' keys and values, so the
                    # prompt and the tokens so far run through the new weights once, and every later token is
                    # sampled from exactly the new policy (its log-prob is that policy's).
                    version = self.weights_version
                    gen = torch.stack(toks, dim=1)[live]
                    k = torch.arange(1, gen.shape[1] + 1, device=self.device)
                    live_pos = pos[..., live, :]
                    out = self.model(input_ids=torch.cat([ids[live], gen], dim=1), attention_mask=mask,
                                     position_ids=torch.cat([live_pos, live_pos[..., -1:] + k], dim=-1),
                                     use_cache=True, **vis)
                else:
                    out = self.model(input_ids=tok[live][:, None], attention_mask=mask,
                                     position_ids=last_pos[..., None], past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :]
        tok_m = torch.stack(toks, dim=1).cpu().tolist()
        lp_m = torch.stack(lps, dim=1).cpu().tolist()
        stop_set = set(stop_ids.cpu().tolist())
        results: list[SampleOut] = []
        for i in range(b):
            t_row, l_row, reason = [], [], "length"
            for t, lp in zip(tok_m[i], lp_m[i]):
                t_row.append(t)
                l_row.append(lp)
                if t in stop_set:
                    reason = "stop"
                    break
            results.append(SampleOut(token_ids=t_row, logprobs=l_row, finish_reason=reason,
                                     versions=versions[:len(t_row)]))
        return results

    def _generators(self, prompts: int, params: SamplingParams) -> list[torch.Generator]:
        """One generator per row (prompt i's sample j: seed s_i + j), so that a sample does not depend on the other
        rows of the batch; rows without a seed share one nondeterministic generator."""
        shared = None
        gens = []
        for i in range(prompts):
            seed = params.prompt_seed(i)
            for j in range(params.n):
                if seed is None:
                    if shared is None:
                        shared = torch.Generator(device=self.device)
                        shared.seed()
                    gens.append(shared)
                else:
                    gens.append(torch.Generator(device=self.device).manual_seed((seed + j) % 2**63))
        return gens

    @staticmethod
    def _sample(probs: torch.Tensor, gens: list[torch.Generator], done: torch.Tensor) -> torch.Tensor:
        """One token per row from its own generator (rows already done draw nothing: their token is padding).

        torch.multinomial draws one sample as argmax(p / q), q ~ Exp(1) from the generator: the rows' q are drawn
        one by one (each row's own stream, the same draws) and the rest runs once for the batch, the same tokens
        at a sixth of the per-row calls' cost."""
        q = torch.ones_like(probs)
        for r in (~done).nonzero().flatten().tolist():
            q[r].exponential_(generator=gens[r])
        return torch.where(done, 0, (probs / q).argmax(dim=-1))

    def prompt_top_logprobs(self, token_ids: list[list[int]], prompt_lens: list[int], k: int,
                            cancel: threading.Event | None = None, images: list[list[bytes]] | None = None
                            ) -> TopLogprobs:
        self._check_images([t[:n] for t, n in zip(token_ids, prompt_lens)], images)
        out = TopLogprobs([], [], [])
        for start in range(0, len(token_ids), self.batch_samples):
            end = start + self.batch_samples
            with self._turns.turn(cancel):
                part = self._prompt_logprobs(token_ids[start:end], prompt_lens[start:end], k,
                                             images[start:end] if images else None)
            out.logprobs += part.logprobs
            out.top_ids += part.top_ids
            out.top_logprobs += part.top_logprobs
            # In flight, chunks may straddle a swap: the oldest version that computed a row (as for samples).
            out.version = part.version if out.version is None else min(out.version, part.version)
        return out

    @torch.inference_mode()
    def _prompt_logprobs(self, token_ids: list[list[int]], prompt_lens: list[int], k: int,
                         row_images: list[list[bytes]] | None = None) -> TopLogprobs:
        if not token_ids:
            return TopLogprobs([], [], [])
        b = len(token_ids)
        width = max(len(t) for t in token_ids)
        # Right padding: real tokens keep positions 0..len-1, exactly as in an unpadded forward.
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, t in enumerate(token_ids):
            ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
            mask[i, :len(t)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        vis = self._vision(row_images)
        with self._steps.step():
            version = self.weights_version
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=self._positions(ids, mask, vis),
                                **vis).logits.float()
        if not bool(torch.isfinite(logits).all()):
            raise PolicyNotFinite("the model's logits are not finite")
        all_lp = torch.log_softmax(logits[:, :-1, :], dim=-1)
        logp = all_lp.gather(-1, ids[:, 1:, None].to(self.device)).squeeze(-1).cpu()
        # Position j predicts token j+1, so tokens[pl:] are scored by positions pl-1 .. len-2 (pl >= 1).
        spans = [(pl - 1, len(t) - 1) for t, pl in zip(token_ids, prompt_lens)]
        out = TopLogprobs([logp[i, a:z].tolist() for i, (a, z) in enumerate(spans)], [], [], version)
        if k:
            top_lp, top_ids = (x.cpu() for x in all_lp.topk(k, dim=-1))
            out.top_ids = [top_ids[i, a:z].tolist() for i, (a, z) in enumerate(spans)]
            out.top_logprobs = [top_lp[i, a:z].tolist() for i, (a, z) in enumerate(spans)]
        return out

    # ------------------------------------------------------------------ weights

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self._params.items()}

    @torch.inference_mode()
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        # No lock of its own: the server loads with no generation running (its weight gate) or inside swapping(),
        # and a version that comes in several buckets must load whole before the next decoding step.
        for name, t in named_tensors:
            dst = self._params[name]
            dst.copy_(t.to(device=dst.device, dtype=dst.dtype))

    def swapping(self):
        return self._steps.swap()

    def close(self) -> None:
        self.model = None
        self._params = {}
