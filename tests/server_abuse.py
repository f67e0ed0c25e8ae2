"""What a buggy client or agent sends a rollout server, as checks shared by the HF-engine and vLLM-engine server tests:
every malformed input is a 4xx with a one-line message naming the field, nothing a client sends is a 5xx, a dropped
request frees the server, and a small request is not starved by a large one."""

from __future__ import annotations

import json
import threading
import time

import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def post_raw(srv, path: str, raw: bytes, timeout: float = 30) -> requests.Response:
    """A body as given (Python's JSON writes NaN; requests' own encoder would refuse it)."""
    return srv.s.post(srv.url + path, data=raw, headers={"content-type": "application/json"}, timeout=timeout)


def error(r: requests.Response) -> str:
    """The one-line error of a refused request ({"error": msg}, or OpenAI's {"error": {"message": msg}} on /v1/)."""
    msg = r.json()["error"]
    if isinstance(msg, dict):
        assert msg["code"] == r.status_code and msg["type"], msg
        msg = msg["message"]
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def check_malformed_inputs_are_4xx_naming_the_field(srv, samples_limit: int) -> None:
    cases = [
        ("/generate", b'{"prompt_token_ids": [[5, 6]], "temperature": NaN}', "temperature: NaN is not a number"),
        ("/generate", b'{"prompt_token_ids": [[5, 6]], "top_p": Infinity}', "top_p: Infinity is not a number"),
        ("/generate", b'{"prompt_token_ids": [[5, 6]], "max_new_tokens": 4, "seed": 1e999}', "seed: inf is out of range"),
        ("/logprobs", b'{"token_ids": [[5, 6, 7]], "prompt_lens": [-Infinity]}', "prompt_lens[0]: -Infinity"),
        ("/v1/completions", b'{"prompt": "copy", "temperature": NaN}', "temperature: NaN"),
        ("/generate", b"[" * 5000 + b"]" * 5000, "nested deeper than 16 levels"),
        ("/v1/completions", b"[" * 5000 + b"]" * 5000, "nested deeper than 16 levels"),
        ("/v1/completions", b'{"prompt": "copy \\udcff 7"}', "prompt: text holds '\\udcff', a lone surrogate"),
        ("/v1/completions", b'{"prompt": ["ok", "\\ud800"]}', "prompt[1]: text holds"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}', "top_p: NaN"),
        ("/v1/chat/completions", b'{"messages": "hi"}', "messages: expected a non-empty list"),
        ("/v1/chat/completions", b'{"messages": [{"role": "robot", "content": "x"}]}', "messages[0].role: 'robot'"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udcff"}]}', "messages[0].content: text"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "tools": []}', "tools: expected a non-empty list"),
        ("/generate", json.dumps({"prompt_token_ids": [[5]], "n": 1_000_000}).encode(),
         f"n: 1 prompt(s) x n 1000000 = 1000000 samples exceed rollout.max_samples_per_request {samples_limit}"),
        ("/v1/completions", json.dumps({"prompt": [5, 6], "n": 10**9}).encode(), "rollout.max_samples_per_request"),
        ("/generate", json.dumps({"prompt_token_ids": [[5]] * (samples_limit + 1)}).encode(),
         "rollout.max_samples_per_request"),
        ("/logprobs", json.dumps({"token_ids": [[5, 6]] * (samples_limit + 1),
                                  "prompt_lens": [1] * (samples_limit + 1)}).encode(), "rollout.max_samples_per_request"),
        ("/generate", json.dumps({"prompt_token_ids": [[5]], "stop_token_ids": [10**30]}).encode(), "stop_token_ids[0]"),
        ("/generate", json.dumps({"prompt_token_ids": [[5]], "seed": 2**70}).encode(), "seed: must be <="),
    ]
    for path, raw, needle in cases:
        r = post_raw(srv, path, raw)
        assert r.status_code == 400, (path, raw[:80], r.status_code, r.text[:300])
        assert needle in error(r), (path, raw[:80], error(r))
    assert srv.s.get(srv.url + "/health", timeout=5).status_code == 200


# Values a fuzzer puts in a field: the right type, the wrong one, out of range, non-finite, deep, odd text.
_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 40),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["\ud800", "copy 7 :", ""]))
_VALUES = st.recursive(_LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                       max_leaves=12)
_IDS = st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=6), min_size=1, max_size=3)
# Each field: a value that fits (drawn mostly) or an odd one (_ODD, or _VALUES: anything at all).
_ODD = {"n": st.integers(-1, 10**7), "max_new_tokens": st.integers(-1, 10**6), "temperature": st.floats(allow_nan=True),
        "top_p": st.floats(allow_nan=True), "top_k": st.integers(-3, 50), "seed": st.integers(-5, 2**64),
        "stop_token_ids": st.lists(st.integers(-5, 10**20), max_size=3), "prompt_lens": st.lists(st.integers(-1, 8)),
        "max_tokens": st.integers(-1, 10**6), "logprobs": st.integers(-1, 3), "seeds": st.lists(st.integers(-1, 2**64))}
_FIELDS = {
    "/generate": {"prompt_token_ids": _IDS, "n": st.integers(1, 4), "max_new_tokens": st.integers(1, 8),
                  "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.sampled_from([-1, 1, 5]),
                  "stop_token_ids": st.lists(st.integers(0, 20), max_size=3), "seed": st.integers(0, 2**40)},
    "/logprobs": {"token_ids": st.lists(st.lists(st.integers(0, 20), min_size=2, max_size=6), min_size=1, max_size=1),
                  "prompt_lens": st.just([1])},
    "/v1/completions": {"prompt": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3), _IDS),
                        "max_tokens": st.integers(1, 8), "n": st.integers(1, 3), "temperature": st.floats(0, 2),
                        "logprobs": st.sampled_from([None, 0]), "model": st.text(max_size=5), "stream": st.just(False),
                        "echo": st.just(False)},
    "/v1/chat/completions": {
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "bot"]),
                                                    "content": st.one_of(st.text(max_size=12), st.none())}),
                             min_size=1, max_size=3),
        "max_tokens": st.integers(1, 8), "n": st.integers(1, 3), "temperature": st.floats(0, 2),
        "logprobs": st.sampled_from([None, False, True]), "return_token_ids": st.booleans(), "model": st.text(max_size=5)},
}
_REQUIRED = {"/generate": ["prompt_token_ids"], "/logprobs": ["token_ids", "prompt_lens"], "/v1/completions": ["prompt"],
             "/v1/chat/completions": ["messages"]}


@st.composite
def bodies(draw):
    """A route and a body: its fields mostly with fitting values, some odd, sometimes an unknown field or anything."""
    path = draw(st.sampled_from(sorted(_FIELDS)))
    fields = _FIELDS[path]
    if draw(st.integers(0, 9)) == 0:
        return path, draw(_VALUES)
    optional = sorted(set(fields) - set(_REQUIRED[path]))
    keys = _REQUIRED[path] + (draw(st.lists(st.sampled_from(optional), unique=True)) if optional else [])
    if draw(st.integers(0, 5)) == 0:
        keys.remove(draw(st.sampled_from(keys)))
    body = {}
    for k in keys:
        odd = draw(st.integers(0, 7)) == 0
        body[k] = draw(st.one_of(_ODD.get(k, _VALUES), _VALUES) if odd else fields[k])
    if draw(st.integers(0, 7)) == 0:
        body[draw(st.text(min_size=1, max_size=6))] = draw(_VALUES)
    return path, body


def fuzz_bodies_never_5xx(srv, examples: int) -> None:
    """Random bodies of /generate, /logprobs, /v1/completions, /v1/chat/completions: never a 5xx, and the server answers /health after."""
    seen: dict[int, int] = {}

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(bodies())
    def one(case):
        path, body = case
        raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        r = post_raw(srv, path, raw, timeout=60)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:300])
        if r.status_code != 200:
            error(r)
        assert srv.s.get(srv.url + "/health", timeout=10).status_code == 200

    one()
    assert seen.get(400, 0) > 0 and seen.get(200, 0) > 0, seen  # the fuzzer reached both sides


def long_request(srv, samples: int, tokens: int) -> dict:
    return {"prompt_token_ids": [[5, 6, 7]] * samples, "n": 1, "max_new_tokens": tokens, "temperature": 1.0,
            "stop_token_ids": [], "seed": 1}


SMALL = {"prompt_token_ids": [[8, 9]], "n": 1, "max_new_tokens": 2, "seed": 2}


def time_alone(srv, body: dict) -> float:
    t0 = time.monotonic()
    r = srv.s.post(srv.url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def check_dropped_request_frees_the_server(srv, body: dict, alone_s: float) -> float:
    """Start `body` (alone it takes alone_s), drop it after a moment (the client's timeout closes the connection);
    a small request sent then is answered in well under the dropped one's time. Returns the small one's seconds."""
    before = srv.s.get(srv.url + "/metrics", timeout=5).json()["cancelled"]
    session = requests.Session()
    session.headers.update(srv.s.headers)
    try:
        session.post(srv.url + "/generate", json=body, timeout=min(1.0, alone_s / 4))
        raise AssertionError("the long request finished within its short timeout: it is not long here")
    except requests.Timeout:
        pass
    session.close()
    small_s = time_alone(srv, SMALL)
    deadline = time.monotonic() + 10
    while srv.s.get(srv.url + "/metrics", timeout=5).json()["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert srv.s.get(srv.url + "/metrics", timeout=5).json()["cancelled"] == before + 1
    assert srv.s.get(srv.url + "/metrics", timeout=5).json()["in_flight"] == 0
    return small_s


def check_small_request_beside_large_one(srv, body: dict) -> float:
    """A small request sent while the largest allowed request runs: its answer's wait in seconds."""
    out: dict = {}

    def large():
        out["large"] = srv.s.post(srv.url + "/generate", json=body, timeout=600).status_code

    t = threading.Thread(target=large)
    t.start()
    time.sleep(0.5)  # the large request is generating
    small_s = time_alone(srv, SMALL)
    t.join()
    assert out["large"] == 200
    return small_s
