"""reward.judge on rank 0: each sample's judge prompt (rewards/judge.py), sent in one batch to the run's judge servers
(services.judge.path: spread over them like generations, greedy unless reward.judge.temperature) or to an
OpenAI-compatible endpoint (services.judge.url, the key from the environment variable services.judge.api_key_env),
and each answer parsed into the part "judge" (reward.judge.fallback where it does not parse)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

from ..config import JobConfig
from ..errors import ConfigError, RolloutError, first_line
from ..rewards.judge import compile_template, make_parser, render
from ..rollout.wire.sampling import SamplingParams

# Requests in flight to an external endpoint at once.
ENDPOINT_CONCURRENCY = 16


@dataclass
class Judgments:
    """One batch's verdicts."""

    scores: list[float]  # parsed, or the fallback
    answers: list[str]  # the judge's answers as it wrote them
    failed: int  # answers that did not parse
    seconds: float

    def stats(self) -> dict:
        n = len(self.scores)
        return {"judge/parse_failed_frac": self.failed / n if n else 0.0, "judge_seconds": self.seconds,
                "judge/s": n / self.seconds if self.seconds > 0 else 0.0}


class Endpoint:
    """An OpenAI-compatible chat endpoint (services.judge.url)."""

    def __init__(self, url: str, key_env: str | None, model: str, timeout_s: float):
        self.url, self.model, self.timeout_s = url.rstrip("/"), model, timeout_s
        self.session = requests.Session()
        key = os.environ.get(key_env, "") if key_env else ""
        if key_env and not key:
            raise ConfigError(f"services.judge.api_key_env: the environment variable {key_env} is not set; export the "
                              "endpoint's API key under that name")
        if key:
            self.session.headers["Authorization"] = f"Bearer {key}"
        self.key_env = key_env

    def check(self) -> None:
        """One request before the run starts: a refused key or a wrong URL is one line now, not at step 1."""
        self.chat(["Answer yes."], 1, 0.0)

    def chat(self, prompts: list[str], max_tokens: int, temperature: float) -> list[str]:
        with ThreadPoolExecutor(min(ENDPOINT_CONCURRENCY, max(1, len(prompts)))) as pool:
            return list(pool.map(lambda p: self._one(p, max_tokens, temperature), prompts))

    def _one(self, prompt: str, max_tokens: int, temperature: float) -> str:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": temperature}
        try:
            r = self.session.post(f"{self.url}/chat/completions", json=body, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise RolloutError(f"services.judge.url: {self.url} did not answer ({first_line(e)})") from None
        if r.status_code in (401, 403):
            raise RolloutError(f"services.judge.url: {self.url} refused the key (HTTP {r.status_code}"
                               f"{f', from ${self.key_env}' if self.key_env else ', none sent'}); set "
                               "services.judge.api_key_env to the variable that holds a valid key")
        if r.status_code != 200:
            raise RolloutError(f"services.judge.url: {self.url}/chat/completions answered HTTP {r.status_code}: "
                               f"{r.text[:200]}")
        try:
            return str(r.json()["choices"][0]["message"]["content"] or "")
        except (ValueError, KeyError, IndexError, TypeError):
            raise RolloutError(f"services.judge.url: {self.url} answered no chat completion: {r.text[:200]}") from None


class Judge:
    """The judge of a run: its template, parser and who answers."""

    def __init__(self, cfg: JobConfig, client=None, tokenizer=None):
        self.cfg = cfg
        j, svc = cfg.reward.judge, cfg.services.judge
        self.template = compile_template(j.template)
        self.parse = make_parser(j)
        self.client, self.tokenizer = client, tokenizer  # the run's judge servers and the judge's tokenizer
        self.endpoint = None
        if svc.url:
            self.endpoint = Endpoint(svc.url, svc.api_key_env, svc.model, cfg.rollout.request_timeout_s)

    def prompts(self, prompt_texts: list[str], texts: list[str], rows: list[dict]) -> list[str]:
        return [render(self.template, p, c, row) for p, c, row in zip(prompt_texts, texts, rows)]

    def answers(self, prompts: list[str], step: int) -> list[str]:
        j = self.cfg.reward.judge
        if self.endpoint is not None:
            return self.endpoint.chat(prompts, j.max_new_tokens, j.temperature)
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in prompts]
        else:
            texts = prompts
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        self.client.rejoin()  # judge servers that joined (a rollout job's) or came back since the last step
        params = SamplingParams(n=1, max_new_tokens=j.max_new_tokens, temperature=j.temperature,
                                stop_token_ids=[tok.eos_token_id], seed=self.cfg.seed * 1_000_003 + step)
        res = self.client.generate(ids, params, step=step)
        return [tok.decode(out[0].token_ids, skip_special_tokens=True) for out in res.outputs]

    def __call__(self, prompt_texts: list[str], texts: list[str], rows: list[dict], step: int) -> Judgments:
        t0 = time.time()
        answers = self.answers(self.prompts(prompt_texts, texts, rows), step)
        fallback = self.cfg.reward.judge.fallback
        scores, failed = [], 0
        for answer, row in zip(answers, rows):
            v = self.parse(answer, row)
            failed += v is None
            scores.append(fallback if v is None else v)
        return Judgments(scores, answers, failed, time.time() - t0)
