"""The OpenAI-compatible front that a run's agents call (rank 0, loopback only, the run token as the API key).

Each episode gets a base URL of its own (`/e/EPISODE/v1`), so its calls are recorded as its own without the agent
passing anything but its client. A call goes to the rollout servers through the run's client, as native generation
does (load balancing, failover, elastic membership), with the seed hpc-rl gives that call of that episode and the
run's sampling settings as defaults. Calls of all running episodes are sent together as waves (one request per wave,
as the multi-turn loop does), and each is recorded with the engine's prompt and completion token ids, their log-probs
and the policy version (agent_trace.Call).

Token-exact conversations: when a chat call repeats the episode's previous call with the assistant's reply appended
as it was returned, and only adds messages after it, its prompt is the previous call's prompt and completion ids
followed by the new messages rendered as the chat template continues the turn (environments/chat.py), never the
reply's text tokenized again. So an agent that appends is one sequence on the engine's tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..errors import HpcRlError, RolloutError, first_line
from ..rollout.environments.chat import ChatFormat
from ..rollout.wire import openai_api
from ..rollout.wire.protocol import BadRequest, RequestLimits
from ..rollout.wire.sampling import SamplingParams
from ..rollout.wire.tool_calls import check_template_tools
from .agent_trace import Call

log = logging.getLogger("hpc_rl")

MAX_BODY = 16 << 20  # bytes of one request body
GATHER_S = 0.005  # how long a free wave slot waits for more calls of the running episodes
MAX_WAVES = 2  # waves in flight: one is generated while the next gathers
ENCODE_CACHE = 4096  # text prompts whose token ids the front keeps


@dataclass
class Episode:
    """What the front knows of one running episode."""

    seed_of_call: Callable[[int], int | None]  # the seed of the episode's k-th call (0-based)
    defaults: openai_api.Defaults  # what a call leaves out: the generation's settings (training's or eval's)
    step: int  # names the generation in errors
    calls: list[Call] = field(default_factory=list)
    messages: list[dict] | None = None  # the last chat call's messages + the reply as returned
    tools: str | None = None  # ... and its tools (as JSON): a call with other tools is a new prompt
    ids: list[int] = field(default_factory=list)  # ... and its prompt + completion token ids
    last: tuple[int | None, bool] = (None, False)  # its last token and whether it was a stop token
    issued: int = 0  # calls made (the next call's index, for its seed)
    waiting: int = 0  # its calls being generated


@dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    step: int
    future: Future  # a thread's call (concurrent.futures), or an in-process call's asyncio future on `loop`
    loop: asyncio.AbstractEventLoop | None = None


class AgentFront:
    """Serves /e/EPISODE/v1/{models,chat/completions,completions} on 127.0.0.1 and records every call."""

    def __init__(self, tokenizer, client, stop_ids: list[int], limits: RequestLimits, vocab: int | None, token: str,
                 model_name: str):
        self.tokenizer, self.client = tokenizer, client
        self.stop_ids, self.limits, self.vocab, self.token, self.model_name = stop_ids, limits, vocab, token, model_name
        self.fmt = ChatFormat(tokenizer) if getattr(tokenizer, "chat_template", None) else None
        self._tool_fmts: dict[str, ChatFormat] = {}  # the chat format of each set of tools calls sent (JSON)
        self._episodes: dict[str, Episode] = {}
        self._encoded: dict[str, list[int]] = {}  # text prompt -> ids (_encode)
        self._lock = threading.Condition()
        self._pending: list[_Pending] = []
        self._closed = False
        self.server_error: RolloutError | None = None  # a wave no server answered (AgentRollout.run raises it)
        self._waves = ThreadPoolExecutor(MAX_WAVES, thread_name_prefix="agent-wave")
        self._slots = threading.Semaphore(MAX_WAVES)
        self._dispatcher = threading.Thread(target=self._dispatch, name="agent-front-dispatch", daemon=True)
        self._dispatcher.start()
        front = self

        class Handler(_Handler):
            owner = front

        self._http = _Server(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self._serve = threading.Thread(target=self._http.serve_forever, name="agent-front", daemon=True)
        self._serve.start()
        self.port = self._http.server_address[1]

    # ------------------------------------------------------------------ episodes

    def url(self, episode: str) -> str:
        return f"http://127.0.0.1:{self.port}/e/{episode}/v1"

    def open(self, episode: str, seed_of_call: Callable[[int], int | None], defaults: openai_api.Defaults,
             step: int) -> None:
        with self._lock:
            self._episodes[episode] = Episode(seed_of_call, defaults, step)

    def close(self, episode: str) -> list[Call]:
        """The episode's recorded calls; later calls of it are refused (its agent timed out or finished)."""
        with self._lock:
            ep = self._episodes.pop(episode, None)
            self._lock.notify_all()
        return ep.calls if ep is not None else []

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._http.shutdown()
        self._http.server_close()
        self._waves.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ one call

    def models(self) -> dict:
        return openai_api.models_response(self.model_name, int(getattr(self.client, "pushed_version", None) or 0),
                                          self.limits.max_model_len, time.time())

    def call(self, episode: str, route: str, body) -> dict:
        """A chat or text completion for `episode`, recorded; BadRequest for what the agent got wrong."""
        fut: Future = Future()
        ep, req, msgs = self._begin(episode, route, body, fut, None)
        return self._end(ep, route, req, msgs, *fut.result())

    async def acall(self, episode: str, route: str, body) -> dict:
        """`call` for an agent's in-process client: the event loop goes on while the wave is generated."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        ep, req, msgs = self._begin(episode, route, body, fut, loop)
        return self._end(ep, route, req, msgs, *await fut)

    def request(self, method: str, path: str, auth: str, raw: bytes) -> tuple[int, dict, tuple | None]:
        """An HTTP request as (status, error body, None), or (200, {}, (episode, route, body)) to be answered by
        `call`/`acall`: the routes, the API key and the JSON checked in one place for both transports."""
        if not hmac.compare_digest(auth.encode(), f"Bearer {self.token}".encode()):
            return _error(401, "missing or wrong API key: use the run token (the client hpc-rl gives the agent has it)")
        parts = path.split("?", 1)[0].strip("/").split("/", 3)
        if len(parts) < 4 or parts[0] != "e" or parts[2] != "v1":
            return _error(404, f"{path}: not served; the routes are /e/EPISODE/v1/models, /chat/completions and "
                          "/completions")
        episode, route = parts[1], parts[3]
        if method == "GET" and route == "models":
            return 200, self.models(), None
        if method != "POST" or route not in ("chat/completions", "completions"):
            return _error(404, f"{method} {path}: not served; POST /e/EPISODE/v1/chat/completions or /completions")
        if len(raw) > MAX_BODY:
            return _error(413, f"body of {len(raw)} bytes; at most {MAX_BODY}")
        try:
            body = json.loads(raw or b"null")
        except (ValueError, UnicodeDecodeError) as e:
            return _error(400, f"body: not JSON ({first_line(e)})")
        return 200, {}, (episode, route, body)

    def _begin(self, episode: str, route: str, body, fut, loop):
        with self._lock:
            ep = self._episodes.get(episode)
        if ep is None:
            raise BadRequest(f"episode {episode}: not running (it finished or timed out); a client of an episode "
                             "serves only that episode")
        msgs: list[dict] = []  # a chat call's messages as parse_chat checked them
        tools_key: list[str | None] = [None]  # ... and its tools
        if route == "chat/completions":
            if self.fmt is None:
                raise BadRequest("messages: the policy's tokenizer has no chat template; call /v1/completions with text")

            def render(messages: list[dict], tools: list[dict] | None) -> list[int]:
                msgs[:] = messages
                tools_key[0] = json.dumps(tools, sort_keys=True) if tools else None
                fmt = self._format(tools, tools_key[0])
                chained = self._continuation(ep, messages, fmt, tools_key[0])
                if chained is not None:
                    return chained
                try:
                    return fmt.prompt_ids(messages)
                except Exception as e:  # the template's own checks, or jinja failing on the input
                    raise BadRequest(f"messages: the model's chat template refused them: {first_line(e)}") from None

            req = openai_api.parse_chat(body, render, self.vocab, self.limits, ep.defaults)
        else:
            req = openai_api.parse_completions(body, self._encode, self.vocab, self.limits, ep.defaults)
        if len(req.prompts) != 1 or req.params.n != 1:
            raise BadRequest("n: an agent's call samples one completion of one prompt (n 1); call again for more")
        with self._lock:
            k = ep.issued
            ep.issued += 1
        params = dataclasses.replace(req.params, stop_token_ids=list(self.stop_ids), seed=None,
                                     seeds=[ep.seed_of_call(k)])
        with self._lock:
            ep.waiting += 1
            self._pending.append(_Pending(req.prompts[0], params, ep.step, fut, loop))
            self._lock.notify_all()
        return ep, req, msgs

    def _end(self, ep: Episode, route: str, req, msgs: list[dict], out, version) -> dict:
        call = Call(list(req.prompts[0]), list(out.token_ids), list(out.logprobs), int(version), out.finish_reason)
        text = self._decode(out.token_ids)
        with self._lock:
            ep.waiting -= 1
            ep.calls.append(call)
            if route == "chat/completions":
                ep.messages = [_plain(m) for m in msgs] + [_plain(openai_api.assistant_message(req, text))]
                ep.tools = json.dumps(req.tools, sort_keys=True) if req.tools else None
                ep.ids = call.prompt_ids + call.completion_ids
                last = out.token_ids[-1] if out.token_ids else None
                ep.last = (last, out.finish_reason == "stop" and last in self.stop_ids)
        respond = openai_api.chat_response if route == "chat/completions" else openai_api.completion_response
        whole = out.token_ids

        def decode(ids: list[int]) -> str:  # the completion is decoded once (above); its tokens' pieces here
            return text if ids is whole else self._decode(ids)

        return respond(req, [[out]], decode, self.model_name, int(version))

    def answer(self, episode: str, route: str, body) -> tuple[int, dict]:
        """(status, body) of `call`: an API error for the agent when it raises (the run logs an unexpected one)."""
        try:
            return 200, self.call(episode, route, body)
        except Exception as e:  # noqa: BLE001 - the agent gets an API error, not the run
            return _failure(e)

    async def aanswer(self, episode: str, route: str, body) -> tuple[int, dict]:
        """`answer` of an in-process call."""
        try:
            return 200, await self.acall(episode, route, body)
        except Exception as e:  # noqa: BLE001 - as answer
            return _failure(e)

    def _format(self, tools: list[dict] | None, key: str | None) -> ChatFormat:
        """The chat format that renders a call's messages with its tools (one per set of tools)."""
        if not tools:
            return self.fmt
        fmt = self._tool_fmts.get(key)
        if fmt is None:
            check_template_tools(self.tokenizer, tools, "the policy")
            try:
                fmt = ChatFormat(self.tokenizer, tools)
            except Exception as e:  # the template's own checks on the tools
                raise BadRequest(f"tools: the model's chat template refused them: {first_line(e)}") from None
            with self._lock:
                self._tool_fmts[key] = fmt
        return fmt

    def _continuation(self, ep: Episode, messages: list[dict], fmt: ChatFormat, tools: str | None) -> list[int] | None:
        """The prompt ids of a call that appends to the episode's last chat call (see the module's docstring)."""
        prev = ep.messages
        if prev is None or len(messages) <= len(prev) or tools != ep.tools:
            return None
        if [_plain(m) for m in messages[:len(prev)]] != prev:
            return None
        new = messages[len(prev):]
        if any(m.get("role") == "assistant" for m in new):
            return None
        try:
            return ep.ids + fmt.observation_ids([_tool_result(m) for m in new], *ep.last)
        except Exception:  # a template that renders the turns differently once more follow: a fresh prompt
            return None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _encode(self, text: str) -> list[int]:
        """A text prompt's ids; the episodes of a group send the same prompt, tokenized once (a bounded cache)."""
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= ENCODE_CACHE:
                self._encoded.clear()
            ids = self._encoded[text] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return list(ids)

    # ------------------------------------------------------------------ waves

    def _dispatch(self) -> None:
        """Sends the pending calls as a wave whenever fewer than MAX_WAVES are being generated: the engines stay
        busy, and calls made meanwhile gather into the next wave (bigger while the engines are slow). A free slot
        waits up to GATHER_S for the running episodes' calls unless all of them wait already. Calls with other
        sampling settings (or of another step) go in waves of their own."""
        while True:
            self._slots.acquire()
            with self._lock:
                while not self._pending and not self._closed:
                    self._lock.wait()
                if self._closed:
                    _settle(self._pending, [HpcRlError("the run's agent front closed")] * len(self._pending))
                    return
                deadline = time.monotonic() + GATHER_S
                while not self._closed and not all(e.waiting > 0 for e in self._episodes.values()):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._lock.wait(left)
                pending, self._pending = self._pending, []
            waves: dict[tuple, list[_Pending]] = {}
            for p in pending:
                q = p.params
                waves.setdefault((p.step, q.max_new_tokens, q.temperature, q.top_p, q.top_k), []).append(p)
            for j, wave in enumerate(waves.values()):
                if j:
                    self._slots.acquire()
                self._waves.submit(self._run_wave, wave)

    def _run_wave(self, wave: list[_Pending]) -> None:
        params = dataclasses.replace(wave[0].params, seeds=[p.params.seeds[0] for p in wave])
        try:
            res = self.client.generate([p.prompt for p in wave], params, step=wave[0].step)
        except BaseException as e:  # every call of the wave fails with the cause (the agent sees an API error)
            if isinstance(e, RolloutError):  # no server answered: the run's wait for servers, not the agent's loss
                self.server_error = e
            _settle(wave, [e] * len(wave))
            return
        finally:
            self._slots.release()
        _settle(wave, [(outs[0], version) for outs, version in zip(res.outputs, res.policy_versions)])


def _settle(calls: list[_Pending], outcomes: list) -> None:
    """Each call's result (or exception). An in-process call's future is its event loop's: the outcomes of a wave
    reach each loop in one callback, not a wake-up of the loop per call."""
    by_loop: dict = {}
    for p, out in zip(calls, outcomes):
        if p.loop is None:
            _deliver(p.future, out)
        else:
            by_loop.setdefault(p.loop, []).append((p.future, out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver_all, items)
        except RuntimeError:  # the loop closed (its episodes timed out and the step went on): nobody awaits them
            pass


def _deliver_all(items: list) -> None:
    for fut, out in items:
        _deliver(fut, out)


def _deliver(fut, out) -> None:
    """`out` (a result, or an exception to raise) into `fut`, a concurrent or an asyncio future, unless it is done
    (an in-process call cancelled when its episode timed out)."""
    if fut.done():
        return
    if isinstance(out, BaseException):
        fut.set_exception(out)
    else:
        fut.set_result(out)


def _error(status: int, message: str) -> tuple[int, dict, None]:
    return status, openai_api.error_body(status, message), None


def _failure(e: Exception) -> tuple[int, dict]:
    """(status, body) of a call that raised: 400 for the agent's mistakes, 503 for the run's side, 500 else."""
    if isinstance(e, BadRequest):
        return _error(400, str(e))[:2]
    if isinstance(e, HpcRlError):
        return _error(503, first_line(e))[:2]
    log.warning("agent front: a call failed: %s: %s", type(e).__name__, first_line(e))
    return _error(500, f"{type(e).__name__}: {first_line(e)}")[:2]


def _plain(m: dict) -> dict:
    """A message as the recorded conversation compares it: role, text content and the tool calls' names and
    arguments (their ids are the client's)."""
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    out = {"role": m.get("role"), "content": content if content is not None else ""}
    calls = m.get("tool_calls")
    if calls:
        out["tool_calls"] = [_call_key(c) for c in calls]
    return out


def _call_key(call) -> list:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    return [fn.get("name"), json.dumps(args, sort_keys=True)]


def _tool_result(m: dict) -> dict:
    """A message after the reply, as the template renders it (a tool result keeps its tool_call_id and name)."""
    out = _plain(m)
    for k in ("tool_call_id", "name"):
        if k in m:
            out[k] = m[k]
    return out


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # every running episode may connect at once (the default backlog is 5)


class _Handler(BaseHTTPRequestHandler):
    owner: AgentFront
    protocol_version = "HTTP/1.1"

    def log_message(self, *_args) -> None:  # the run's log has one line per step, not per call
        pass

    def _send(self, status: int, body: dict) -> None:
        data, kind = openai_api.encode(body)
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _answer(self, method: str) -> None:
        try:
            size = int(self.headers.get("Content-Length", "0") or 0)
        except ValueError:
            size = -1
        if size < 0 or size > MAX_BODY:
            self._send(*_error(413, f"Content-Length {self.headers.get('Content-Length')!r}; at most {MAX_BODY}")[:2])
            self.close_connection = True
            return
        raw = self.rfile.read(size) if size else b""
        status, body, work = self.owner.request(method, self.path, self.headers.get("Authorization", ""), raw)
        if work is not None:
            status, body = self.owner.answer(*work)
        self._send(status, body)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")
