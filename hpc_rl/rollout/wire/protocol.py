"""The rollout HTTP API's wire format: size limits, request parsing with one-line errors naming the
field, and (de)serialization of samples. Shared by the server and the client."""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from typing import Any

from .sampling import SampleOut, SamplingParams

# Config-independent limits: JSON requests (a few thousand prompts fit easily) and one weight bucket
# (a single tensor never splits, so a bucket can be as large as a big model's embedding matrix).
MAX_JSON_BYTES = 64 * 1024 * 1024
MAX_WEIGHTS_BYTES = 16 * 1024 * 1024 * 1024
# JSON deeper than this is refused (no route takes more than a few levels; Python's parser recurses, and a body of
# thousands of nested arrays would otherwise raise RecursionError in the server).
MAX_JSON_DEPTH = 16
# How long a leaving (draining) server finishes its generations in flight. Slurm's KillWait (30 s by default)
# follows SIGTERM with SIGKILL; a preemption warning gives slurm.signal_delay_s.
DRAIN_S = 20.0


class BadRequest(Exception):
    """A malformed request; the message names the field. The server answers 400 with it."""


class Busy(Exception):
    """The server holds rollout.max_requests_in_flight requests already: 429 with Retry-After (try another server,
    or again shortly). `retry_after_s` is the wait it suggests."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class RequestLimits:
    """What one request may ask a server for (rollout.max_model_len, max_samples_per_request, max_tokens_per_request)."""

    max_model_len: int
    max_samples: int = 1024
    max_tokens: int | None = None  # None: max_samples x max_model_len

    @classmethod
    def of(cls, rollout) -> RequestLimits:
        """From a job's rollout section."""
        return cls(rollout.max_model_len, rollout.max_samples_per_request, rollout.max_tokens_per_request)

    def check(self, prompts: list[list[int]], n: int, max_new_tokens: int) -> None:
        """BadRequest for a request that can never be served here: too many samples or tokens in all, or a prompt
        whose length + max_new_tokens exceeds max_model_len."""
        samples = len(prompts) * n
        if samples > self.max_samples:
            raise BadRequest(f"n: {len(prompts)} prompt(s) x n {n} = {samples} samples exceed "
                             f"rollout.max_samples_per_request {self.max_samples}; split the request")
        for i, row in enumerate(prompts):
            if len(row) + max_new_tokens > self.max_model_len:
                raise BadRequest(f"prompt_token_ids[{i}]: {len(row)} prompt tokens + max_new_tokens {max_new_tokens} "
                                 f"exceed rollout.max_model_len {self.max_model_len}; shorten the prompt or lower "
                                 "max_new_tokens")
        limit = self.max_tokens if self.max_tokens is not None else self.max_samples * self.max_model_len
        tokens = sum(len(r) for r in prompts) + samples * max_new_tokens
        if tokens > limit:
            raise BadRequest(f"max_new_tokens: the request asks for {tokens} tokens (its prompts + n x max_new_tokens "
                             f"each), more than rollout.max_tokens_per_request {limit}; split the request or ask for "
                             "fewer tokens")


class _NonFinite:
    """What the parser makes of NaN, Infinity and -Infinity (JSON has no such numbers; Python's parser accepts them)."""

    def __init__(self, text: str):
        self.text = text


def load_json(raw: bytes | str) -> Any:
    """A request body as JSON, refused (BadRequest naming the field) when it is not JSON, nests deeper than
    MAX_JSON_DEPTH, holds NaN or +-Infinity, or text UTF-8 cannot encode (a lone surrogate from a \\udXXX escape)."""
    try:
        obj = json.loads(raw, parse_constant=_NonFinite)
    except RecursionError:
        raise BadRequest(f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body: not valid JSON ({str(e).splitlines()[0][:160]})") from None
    _check_json(obj)
    return obj


def _check_json(obj: Any) -> None:
    """Walk the parsed body once (iteratively): depth, non-finite numbers and unencodable text, named by path."""
    stack = [(obj, "body", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, _NonFinite):
            raise BadRequest(f"{path}: {value.text} is not a number JSON allows; send a finite number")
        if isinstance(value, float) and not math.isfinite(value):  # 1e999 parses as inf
            raise BadRequest(f"{path}: {value} is out of range; send a finite number")
        if isinstance(value, str):
            check_text(value, path)
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels")
        is_dict = isinstance(value, dict)
        for k, v in (value.items() if is_dict else enumerate(value)):
            if type(v) is int and not is_dict:  # the bulk of a body (token ids): nothing to check
                continue
            if is_dict:
                check_text(k, f"{path} (a key)")  # before the key is quoted in any path
            child = (k if path == "body" else f"{path}.{k}") if is_dict else f"{path}[{k}]"
            stack.append((v, child, depth + 1))


def check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{path}: text holds {text[e.start]!r}, a lone surrogate UTF-8 cannot encode; send valid "
                         "Unicode text") from None


class PolicyNotFinite(Exception):
    """The engine's forward gave non-finite probabilities (the weights it holds are broken). The server answers 422
    with error_kind NOT_FINITE_KIND and its policy version; the client stops instead of trying another server."""


NOT_FINITE_KIND = "policy_not_finite"


class Draining(Exception):
    """The server is leaving (its job ends or was preempted) and takes no new work: 503, retried elsewhere."""


# A seed s gives the j-th sample s + j: both must fit a generator's 64-bit seed.
MAX_SEED = 2**63 - 2**20


def int_field(v: Any, field: str, lo: int | None = None, hi: int | None = None) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise BadRequest(f"{field}: expected an integer, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise BadRequest(f"{field}: must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise BadRequest(f"{field}: must be <= {hi}, got {v}")
    return v


def _float(v: Any, field: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise BadRequest(f"{field}: expected a number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise BadRequest(f"{field}: {v} is not a finite number")
    return float(v)


def _token_lists(v: Any, field: str, vocab: int | None) -> list[list[int]]:
    if not isinstance(v, list):
        raise BadRequest(f"{field}: expected a list of token-id lists, got {type(v).__name__}")
    out = []
    for i, row in enumerate(v):
        if not isinstance(row, list) or not row:
            raise BadRequest(f"{field}[{i}]: expected a non-empty list of token ids")
        for t in row:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab is not None and t >= vocab):
                raise BadRequest(f"{field}[{i}]: token id {t!r} is not an integer in [0, {vocab})")
        out.append(row)
    return out


def json_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("body: expected a JSON object")
    return body


def parse_generate(body: Any, vocab: int | None, limits: RequestLimits) -> tuple[list[list[int]], SamplingParams]:
    """Validate a /generate body against the server's limits (a request that can never be served is named)."""
    body = json_object(body)
    known = {"prompt_token_ids", "n", "max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "seed",
             "seeds", "images"}
    extra = sorted(set(body) - known)
    if extra:
        raise BadRequest(f"{extra[0]}: unknown field; valid fields are {', '.join(sorted(known))}")
    if "prompt_token_ids" not in body:
        raise BadRequest("prompt_token_ids: missing; send a list of token-id lists")
    prompts = _token_lists(body["prompt_token_ids"], "prompt_token_ids", vocab)
    d = SamplingParams()
    p = SamplingParams(
        n=int_field(body.get("n", d.n), "n", 1),
        max_new_tokens=int_field(body.get("max_new_tokens", d.max_new_tokens), "max_new_tokens", 1),
        temperature=_float(body.get("temperature", d.temperature), "temperature"),
        top_p=_float(body.get("top_p", d.top_p), "top_p"),
        top_k=int_field(body.get("top_k", d.top_k), "top_k"),
        seed=None if body.get("seed") is None else int_field(body.get("seed"), "seed", 0, MAX_SEED),
    )
    if p.temperature < 0:
        raise BadRequest(f"temperature: must be >= 0 (0 = greedy), got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise BadRequest(f"top_p: must be in (0, 1], got {p.top_p}")
    if p.top_k == 0 or p.top_k < -1:
        raise BadRequest(f"top_k: must be -1 (off) or >= 1, got {p.top_k}")
    stops = body.get("stop_token_ids", [])
    if not isinstance(stops, list):
        raise BadRequest("stop_token_ids: expected a list of integer token ids")
    p.stop_token_ids = [int_field(t, f"stop_token_ids[{i}]", 0, (vocab or 2**62) - 1) for i, t in enumerate(stops)]
    seeds = body.get("seeds")
    if seeds is not None:
        if not isinstance(seeds, list) or len(seeds) != len(prompts):
            raise BadRequest(f"seeds: expected a list of {len(prompts)} integer seeds, one per prompt, or null")
        p.seeds = [int_field(s, f"seeds[{i}]", 0, MAX_SEED) for i, s in enumerate(seeds)]
    limits.check(prompts, p.n, p.max_new_tokens)
    return prompts, p


# The most tokens per position /logprobs returns with top_k (algorithm.distill.top_k's bound).
MAX_TOP_K = 64


def parse_logprobs(body: Any, vocab: int | None, limits: RequestLimits) -> tuple[list[list[int]], list[int], int]:
    """Validate a /logprobs body: token_ids and prompt_lens with 1 <= prompt_len <= len(tokens), and top_k (0, the
    default: the tokens' log-probs only; k: also each position's k likeliest tokens, 1 <= k <= MAX_TOP_K)."""
    body = json_object(body)
    extra = sorted(set(body) - {"token_ids", "prompt_lens", "top_k", "images"})
    if extra:
        raise BadRequest(f"{extra[0]}: unknown field; /logprobs takes token_ids, prompt_lens, top_k and images")
    for f in ("token_ids", "prompt_lens"):
        if f not in body:
            raise BadRequest(f"{f}: missing")
    toks = _token_lists(body["token_ids"], "token_ids", vocab)
    if len(toks) > limits.max_samples:
        raise BadRequest(f"token_ids: {len(toks)} rows exceed rollout.max_samples_per_request {limits.max_samples}; "
                         "split the request")
    max_model_len = limits.max_model_len
    lens = body["prompt_lens"]
    if not isinstance(lens, list) or len(lens) != len(toks):
        raise BadRequest("prompt_lens: expected a list of integers, one per token_ids row")
    for i, (t, pl) in enumerate(zip(toks, lens)):
        int_field(pl, f"prompt_lens[{i}]", 1)
        if pl > len(t):
            raise BadRequest(f"prompt_lens[{i}]: {pl} exceeds the row's {len(t)} tokens")
        if len(t) > max_model_len:
            raise BadRequest(f"token_ids[{i}]: {len(t)} tokens exceed rollout.max_model_len {max_model_len}")
    top_k = int_field(body.get("top_k", 0), "top_k", 0, MAX_TOP_K)
    if vocab is not None and top_k > vocab:
        raise BadRequest(f"top_k: {top_k} exceeds the model's {vocab} tokens")
    return toks, lens, top_k


def parse_load_file(body: Any) -> tuple[str, int]:
    body = json_object(body)
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise BadRequest("path: expected the path of a .safetensors file or folder under RUN/weights")
    return path, int_field(body.get("version"), "version", 0)


def params_to_json(prompts: list[list[int]], p: SamplingParams, images: list[list[bytes]] | None = None) -> dict:
    """The /generate request body; `images[i]`: prompt i's encoded images (base64 in the body)."""
    body = {"prompt_token_ids": prompts, "n": p.n, "max_new_tokens": p.max_new_tokens,
            "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
            "stop_token_ids": list(p.stop_token_ids), "seed": p.seed, "seeds": p.seeds}
    if images is not None:
        body["images"] = images_to_json(images)
    return body


def images_to_json(images: list[list[bytes]]) -> list[list[str]]:
    return [[base64.b64encode(b).decode("ascii") for b in row] for row in images]


def parse_images(body: dict, n_prompts: int, field: str = "images") -> list[list[bytes]] | None:
    """The request's images: one list of base64-encoded images per prompt (null or absent: none)."""
    raw = body.get(field)
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != n_prompts:
        raise BadRequest(f"{field}: expected a list of {n_prompts} lists (one per prompt) of base64-encoded images")
    out = []
    for i, row in enumerate(raw):
        if not isinstance(row, list):
            raise BadRequest(f"{field}[{i}]: expected a list of base64-encoded images (empty for none)")
        imgs = []
        for j, b in enumerate(row):
            try:
                imgs.append(base64.b64decode(b, validate=True))
            except (TypeError, ValueError):
                raise BadRequest(f"{field}[{i}][{j}]: not a base64 string; send each image's encoded bytes in "
                                 "base64") from None
        out.append(imgs)
    return out


def outputs_to_json(outputs: list[list[SampleOut]]) -> list[list[dict]]:
    return [[{"token_ids": s.token_ids, "logprobs": s.logprobs, "finish_reason": s.finish_reason,
              **({"versions": s.versions} if s.versions is not None else {})} for s in row]
            for row in outputs]


def outputs_from_json(data: list[list[dict]]) -> list[list[SampleOut]]:
    return [[SampleOut(token_ids=s["token_ids"], logprobs=s["logprobs"], finish_reason=s["finish_reason"],
                       versions=s.get("versions")) for s in row] for row in data]


def parse_score(body: Any, vocab: int | None, max_length: int) -> list[list[int]]:
    """Validate a /v1/score body: {"token_ids": [[...], ...]}, each at most max_length reward-model tokens."""
    body = json_object(body)
    extra = sorted(set(body) - {"token_ids"})
    if extra:
        raise BadRequest(f"{extra[0]}: unknown field; /v1/score takes token_ids (the reward model's token ids of "
                         "prompt + response, one list per sample)")
    if "token_ids" not in body:
        raise BadRequest("token_ids: missing; send a list of token-id lists (the reward model's tokens)")
    rows = _token_lists(body["token_ids"], "token_ids", vocab)
    for i, row in enumerate(rows):
        if len(row) > max_length:
            raise BadRequest(f"token_ids[{i}]: {len(row)} tokens exceed reward.model.max_length {max_length}")
    return rows
