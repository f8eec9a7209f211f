"""Where responses come from: an in-process vLLM engine, or OpenAI-compatible vLLM servers.

Both backends answer requests with one :class:`Completion` (vLLM's own prompt and response token
ids, the finish reason) or one :class:`Failure` each; a failure never raises: the caller reports it
per prompt and the run goes on. Two ways to ask:

* streaming, what regeneration uses: ``submit(key, kind, payload, gen)`` queues one request
  (``kind`` "chat": a conversation; "raw": a plain document) and ``poll()`` returns the
  ``(key, result)`` pairs that finished since, in finishing order. The caller keeps up to
  ``max_in_flight`` requests queued, so the engine never waits for a batch, a shard or a commit
  to end before it starts on the next prompts (continuous batching end to end).
* batched, ``chat(conversations)`` and ``complete(texts)``: one result per request, in order.

The endpoint backend spreads requests over every endpoint (data parallel, a bounded number in
flight each) and retries a failed request on the next endpoint after an exponential backoff. It asks
the servers for token ids (``return_token_ids``), so no re-tokenisation happens on this side; the
first chat answer of each endpoint is checked against the target's own chat template, so a server
running another template is refused rather than silently mixed in. Endpoints must be loopback unless
the recipe says otherwise; the API key is read from an environment variable whose *name* is the only
thing the config, logs, stats and provenance ever hold. The key goes only where the recipe points: a
redirect to another scheme, host or port is refused (the request fails, the key is not sent), and
plain http to a non-loopback host needs ``ingest.allow_plaintext_api_key``.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from eaglenest.engine import close_llm
from eaglenest.errors import ConfigError, EaglenestError
from eaglenest.hf import load_tokenizer
from eaglenest.ingest.manifest import Generation
from eaglenest.ingest.reasoning import template_kwargs
from eaglenest.provenance import redact

log = logging.getLogger(__name__)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
#: Sampling parameters a request leaves at vLLM's neutral values. A vLLM server fills what a request
#: leaves out from the target's generation_config.json (top_p, top_k, min_p, repetition_penalty, ...),
#: while the in-process engine samples with exactly the SamplingParams it is given: the rows of both
#: backends share one gen_params_id, so they must sample alike (top_k 0: off, since vLLM 0.10).
NEUTRAL_SAMPLING = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}


@dataclasses.dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]
    response_ids: list[int]
    text: str
    finish_reason: str


@dataclasses.dataclass(frozen=True)
class Failure:
    error: str


def chat_kwargs(gen: Generation, base: dict | None = None) -> dict | None:
    """``chat_template_kwargs``: the recipe's ``base`` with the manifest's reasoning switch on top
    (None: the template's defaults). See :mod:`eaglenest.ingest.reasoning`."""
    return template_kwargs(gen.reasoning, base)


class LocalBackend:
    """An in-process ``vllm.LLM`` (the default).

    Streaming requests go through vLLM's own ``LLM.enqueue_chat`` / ``LLM.enqueue`` (so the chat
    template is rendered exactly as ``LLM.chat`` renders it) and the engine's ``step()``. An engine
    core in its own process (``engine.in_process: false``, CUDA's default) keeps generating while this
    process writes and commits; one in this process (CPU's default) waits for them.
    """

    def __init__(self, llm, *, max_in_flight: int = 0, chat_template_kwargs: dict | None = None):
        self.llm = llm
        #: ``ingest.chat_template_kwargs``, merged with each request's reasoning switch.
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        #: Requests kept queued in the engine (0: four times the engine's ``max_num_seqs``).
        self.max_in_flight = max_in_flight or 4 * llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
        self._pending: dict[str, object] = {}  # the caller's request id -> the caller's key
        self._ready: list[tuple[object, Completion | Failure]] = []
        self._sampling: tuple[Generation, object] | None = None

    def _params(self, gen: Generation):
        from vllm import SamplingParams

        return SamplingParams(temperature=gen.temperature, max_tokens=gen.max_tokens, seed=gen.seed)

    def _params_for(self, gen: Generation):
        if self._sampling is None or self._sampling[0] != gen:
            self._sampling = (gen, self._params(gen))
        return self._sampling[1]

    def submit(self, key, kind: str, payload, gen: Generation) -> None:
        params = self._params_for(gen)
        try:
            if kind == "chat":
                (rid,) = self.llm.enqueue_chat([payload], params, use_tqdm=False,
                                               chat_template_kwargs=chat_kwargs(gen, self.chat_template_kwargs))
            else:
                (rid,) = self.llm.enqueue([payload], params, use_tqdm=False)
        except Exception as exc:  # noqa: BLE001 - vLLM refuses one request (too long, bad input): report it
            self._ready.append((key, Failure(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")))
            return
        # vLLM appends "-<random>" to the id internally; outputs carry the id it was given (digits).
        self._pending[rid.split("-", 1)[0]] = key

    def poll(self) -> list[tuple[object, Completion | Failure]]:
        """Requests finished since the last call: at least one, unless none is in flight."""
        out, self._ready = self._ready, []
        engine = self.llm.llm_engine
        while not out and self._pending:
            for o in engine.step():
                if o.finished and o.request_id in self._pending:
                    out.append((self._pending.pop(o.request_id), self._done(o)))
        return out

    def cancel(self) -> None:
        """Abort whatever is still queued (after an error), so the engine can be reused."""
        if self._pending:
            self.llm.llm_engine.abort_request(list(self._pending))
            self._pending.clear()
        self._ready.clear()

    @staticmethod
    def _done(out) -> Completion:
        c = out.outputs[0]
        return Completion(list(out.prompt_token_ids), list(c.token_ids), c.text, str(c.finish_reason or ""))

    def chat(self, conversations: list[list[dict]], gen: Generation) -> list[Completion | Failure]:
        outs = self.llm.chat(conversations, self._params(gen), use_tqdm=False,
                             chat_template_kwargs=chat_kwargs(gen, self.chat_template_kwargs))
        return [self._done(o) for o in outs]

    def complete(self, texts: list[str], gen: Generation) -> list[Completion | Failure]:
        return [self._done(o) for o in self.llm.generate(texts, self._params(gen), use_tqdm=False)]

    def close(self) -> None:
        close_llm(self.llm)


def check_endpoints(urls: list[str], *, allow_remote: bool, key_sent: bool = False,
                    allow_plaintext: bool = False) -> list[str]:
    """Base URLs of ``urls``; a ConfigError naming the key for a URL the recipe did not allow.

    ``key_sent``: an API key goes with every request, so plain http to a host that is not loopback
    (readable by anyone on the path) needs ``allow_plaintext`` (``ingest.allow_plaintext_api_key``).
    """
    out = []
    for i, url in enumerate(urls):
        host = _http_host(url)
        if not host:
            raise ConfigError(f"ingest.endpoints[{i}]: '{url[:80]}' is not an http(s) URL")
        route = _api_route(url)
        if route:
            raise ConfigError(redact(f"ingest.endpoints[{i}]: {url[:80]} {route}; give the server's base URL "
                                     f"({_base_url(url)[:80]}): the /v1/... routes are added to it"))
        if host not in LOOPBACK and not allow_remote:
            raise ConfigError(f"ingest.endpoints[{i}]: {host[:80]} is not loopback; "
                              "set ingest.allow_remote_endpoints=true to use it")
        if key_sent and url.lower().startswith("http:") and host not in LOOPBACK and not allow_plaintext:
            raise ConfigError(f"ingest.allow_plaintext_api_key: ingest.endpoints[{i}] is plain http to "
                              f"{host[:80]}, so the API key would travel unencrypted; use https, or set "
                              "ingest.allow_plaintext_api_key=true")
        out.append(url.rstrip("/").removesuffix("/v1"))
    return out


def _http_host(url: str) -> str | None:
    """The host of an http(s) URL whose port (if any) is valid, else None."""
    try:
        u = urllib.parse.urlparse(url)
        u.port  # noqa: B018 - raises ValueError unless the port is a number in 0-65535
    except ValueError:
        return None
    return u.hostname if u.scheme in ("http", "https") else None


def _api_route(url: str) -> str:
    """What in ``url`` is more than a server's base URL (a prefix path such as a proxy's ``/llm`` is
    fine): an API route (``/v1/chat/completions``: every request went to ``.../v1/chat/v1/models``
    and failed with HTTP 404), a query or a fragment (the routes were appended after them). '' if none."""
    u = urllib.parse.urlsplit(url)
    if u.query or u.fragment:
        return "has a query or fragment"
    path = u.path.rstrip("/").removesuffix("/v1")
    return f"names an API route ({u.path})" if "v1" in path.split("/") else ""


def _base_url(url: str) -> str:
    u = urllib.parse.urlsplit(url)
    path = u.path.split("/v1/", 1)[0] if "/v1/" in u.path + "/" else u.path
    return urllib.parse.urlunsplit((u.scheme, u.netloc, path.rstrip("/"), "", ""))


def _origin(url: str) -> tuple[str, str, int | None]:
    u = urllib.parse.urlsplit(url)
    try:
        port = u.port or {"http": 80, "https": 443}.get(u.scheme)
    except ValueError:
        port = None
    return u.scheme, (u.hostname or ""), port


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to the same scheme, host and port; urllib's default handler would
    carry the ``Authorization`` header to any host a server names."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        target = urllib.parse.urljoin(req.full_url, newurl)
        if _origin(target) != _origin(req.full_url):
            fp.close()
            scheme, host, port = _origin(target)
            raise EaglenestError(f"{req.full_url[:120]}: refused a redirect (HTTP {code}) to another host "
                                 f"({scheme}://{host[:80]}:{port}); credentials never follow one")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _reason(exc: urllib.error.HTTPError, key: str = "", limit: int = 300) -> str:
    """``": <why>"``: the message of an OpenAI-style error body (vLLM's ``{"error": {"message": ...}}``,
    older ``{"message": ...}``), one line of at most ``limit`` characters ("" if the body holds none: a
    proxy's HTML page). vLLM says there why it refused a request (a prompt past its context length),
    which ``HTTP 400`` alone did not. An API ``key`` a server echoes is redacted too."""
    try:
        body = json.loads(exc.read(64 << 10) or b"null")
    except (OSError, ValueError, RecursionError, http.client.HTTPException):
        return ""
    err = body.get("error", body) if isinstance(body, dict) else None
    message = err.get("message") if isinstance(err, dict) else err
    text = " ".join(message.split()) if isinstance(message, str) else ""
    text = redact(text).replace(key, "<redacted>") if key else redact(text)
    return f": {text[:limit]}" if text else ""


def _choice(answer, where: str) -> dict:
    """The first choice of an OpenAI-style answer; an EaglenestError naming ``where`` if it has none
    (a server or proxy that answers 200 with something else)."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EaglenestError(f"{where}: the answer holds no 'choices' list of objects (not an OpenAI completion)")
    return choices[0]


def _is_unicode(text: str) -> bool:
    """Whether ``text`` can be written as UTF-8 (the prompts table's text columns): not if it holds a lone
    surrogate, which a JSON escape (``"\\ud800"``) spells and Arrow refuses, failing the whole shard's write."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _token_ids(value, what: str, where: str) -> list[int]:
    """``value`` if it is a list of token ids (non-negative integers), else an EaglenestError: anything
    else would fail the Arrow write of the whole shard, far from the answer that held it."""
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise EaglenestError(f"{where}: the answer's {what} are not a list of token ids")
    return value


class EndpointBackend:
    """OpenAI-compatible vLLM servers, data parallel, with retries and per-request failures."""

    def __init__(self, urls: list[str], *, target: str, api_key_env: str = "", timeout_s: float = 120.0,
                 max_retries: int = 3, backoff_s: float = 0.5, in_flight_per_endpoint: int = 8,
                 allow_remote: bool = False, max_in_flight: int = 0, allow_plaintext_key: bool = False,
                 chat_template_kwargs: dict | None = None, trust_remote_code: bool = False):
        self.urls = check_endpoints(urls, allow_remote=allow_remote, key_sent=bool(api_key_env),
                                    allow_plaintext=allow_plaintext_key)
        if not self.urls:
            raise ConfigError("ingest.endpoints: at least one URL is required for backend 'endpoints'")
        self._key = os.environ.get(api_key_env, "") if api_key_env else ""
        if api_key_env and not self._key:
            raise ConfigError(f"ingest.api_key_env: environment variable {api_key_env} is not set")
        for scheme, host, _port in map(_origin, self.urls):
            if self._key and scheme == "http" and host not in LOOPBACK:
                log.warning("ingest.allow_plaintext_api_key: the API key goes over plain http to %s", host)
        self._opener = urllib.request.build_opener(_SameOriginRedirects())
        self.target, self.timeout_s = target, timeout_s
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.trust_remote_code = trust_remote_code
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.workers = in_flight_per_endpoint * len(self.urls)
        #: Requests queued at once when streaming (0: twice the concurrent HTTP requests).
        self.max_in_flight = max_in_flight or 2 * self.workers
        self._stream_pool: ThreadPoolExecutor | None = None
        self._futures: dict = {}
        self._submitted = 0
        self._models: dict[str, str] = {}
        self._checked: set[str] = set()
        self._lock = threading.Lock()
        self._tok = None
        self.retries = 0

    # -- HTTP ---------------------------------------------------------------------------------------
    def _post(self, base: str, path: str, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers=headers)
        try:
            with self._opener.open(req, timeout=self.timeout_s) as resp:
                data = resp.read()
        except urllib.error.HTTPError as exc:  # the message never contains our headers
            why = _reason(exc, self._key)
            raise EaglenestError(f"{base}{path}: HTTP {exc.code}{why}") from None
        except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as exc:
            # HTTPException: a port that does not speak HTTP (BadStatusLine), a body cut off (IncompleteRead)
            reason = getattr(exc, "reason", exc)
            raise EaglenestError(f"{base}{path}: {type(reason).__name__}: {str(reason)[:200]}") from None
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as exc:  # a proxy's HTML page; JSON nested past the parser's depth
            raise EaglenestError(f"{base}{path}: the answer is not JSON ({type(exc).__name__})") from None

    def _model(self, base: str) -> str:
        if base not in self._models:
            headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
            req = urllib.request.Request(base + "/v1/models", headers=headers)
            try:
                with self._opener.open(req, timeout=self.timeout_s) as resp:
                    self._models[base] = json.loads(resp.read())["data"][0]["id"]
            except urllib.error.HTTPError as exc:
                why = _reason(exc, self._key)
                raise EaglenestError(f"{base}/v1/models: HTTP {exc.code}{why}") from None
            except (urllib.error.URLError, OSError, http.client.HTTPException, KeyError, IndexError,
                    TypeError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
                raise EaglenestError(f"{base}/v1/models: {type(exc).__name__}") from None
        return self._models[base]

    def _sampling(self, gen: Generation) -> dict:
        return {"temperature": gen.temperature, "max_tokens": gen.max_tokens, "seed": gen.seed, **NEUTRAL_SAMPLING,
                "return_token_ids": True, "skip_special_tokens": True}

    def _one(self, i: int, kind: str, payload, gen: Generation) -> Completion | Failure:
        errors = []
        for attempt in range(self.max_retries + 1):
            base = self.urls[(i + attempt) % len(self.urls)]
            try:
                body = {"model": self._model(base), **self._sampling(gen)}
                if kind == "chat":
                    body["messages"] = payload
                    kwargs = chat_kwargs(gen, self.chat_template_kwargs)
                    if kwargs:
                        body["chat_template_kwargs"] = kwargs
                    path = "/v1/chat/completions"
                    r = self._post(base, path, body)
                    choice = _choice(r, base + path)
                    message = choice.get("message")
                    if not isinstance(message, dict):
                        raise EaglenestError(f"{base}{path}: the answer's choice holds no 'message' object")
                    text = message.get("content")
                else:
                    body["prompt"] = payload
                    path = "/v1/completions"
                    r = self._post(base, path, body)
                    choice = message = _choice(r, base + path)
                    text = choice.get("text")
                served = r.get("model")
                if isinstance(served, str) and served != body["model"]:  # a router's fallback, a swapped server
                    raise EaglenestError(f"{base}{path}: answered by model '{served[:80]}', not '{body['model']}' "
                                         "(the model the server lists and was asked for)")
                ids, prompt_ids = choice.get("token_ids"), r.get("prompt_token_ids") or choice.get("prompt_token_ids")
                if ids is None or prompt_ids is None:
                    raise EaglenestError(f"{base}: server returned no token ids (vLLM >= 0.10 needed)")
                ids, prompt_ids = _token_ids(ids, "token_ids", base + path), _token_ids(prompt_ids, "prompt_token_ids",
                                                                                       base + path)
                if text is not None and not isinstance(text, str):
                    raise EaglenestError(f"{base}{path}: the answer's text is {type(text).__name__}, not a string")
                if text and not _is_unicode(text):  # JSON can spell a lone surrogate; no UTF-8 writer takes it
                    raise EaglenestError(f"{base}{path}: the answer's text is not valid Unicode (a lone surrogate)")
                if kind == "chat" and ids and (message.get("reasoning_content") or message.get("reasoning")):
                    # a server with --reasoning-parser moves the thinking out of `content`; the
                    # stored text keeps it, as the token ids do
                    text = self._tokenizer().decode(ids, skip_special_tokens=True)
                done = Completion(prompt_ids, ids, text or "", str(choice.get("finish_reason") or ""))
                if kind == "chat":
                    self._check_template(base, payload, done, gen)
                return done
            except (EaglenestError, KeyError, IndexError, TypeError, ValueError) as exc:
                if isinstance(exc, ConfigError):
                    raise
                errors.append(str(exc) if isinstance(exc, EaglenestError) else f"{base}: bad response")
                if attempt < self.max_retries:
                    with self._lock:
                        self.retries += 1
                    time.sleep(self.backoff_s * 2 ** attempt)
        return Failure(f"{len(errors)} attempt(s) failed; last: {errors[-1]}")

    def _check_template(self, base: str, messages: list[dict], done: Completion, gen: Generation) -> None:
        with self._lock:
            if base in self._checked:
                return
            try:
                want = self._tokenizer().apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                    **(chat_kwargs(gen, self.chat_template_kwargs) or {}))
            except Exception as exc:  # noqa: BLE001 - jinja's TemplateError (raise_exception) and the like
                why = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
                raise ConfigError(f"ingest.endpoints: {base} rendered a conversation the target {self.target}'s "
                                  f"chat template refuses ({type(exc).__name__}: {why}); the server uses another "
                                  "template: start it with the same model") from None
            if list(want) != done.prompt_ids:
                raise ConfigError(f"ingest.endpoints: {base} renders prompts differently from the target "
                                  f"{self.target}'s chat template; start it with the same model")
            self._checked.add(base)

    def _tokenizer(self):
        if self._tok is None:
            self._tok = load_tokenizer(self.target, trust_remote_code=self.trust_remote_code)
        return self._tok

    def _map(self, kind: str, payloads: list, gen: Generation) -> list[Completion | Failure]:
        with ThreadPoolExecutor(max_workers=min(self.workers, max(1, len(payloads)))) as pool:
            return list(pool.map(lambda ip: self._one(ip[0], kind, ip[1], gen), enumerate(payloads)))

    def chat(self, conversations: list[list[dict]], gen: Generation) -> list[Completion | Failure]:
        return self._map("chat", conversations, gen)

    def complete(self, texts: list[str], gen: Generation) -> list[Completion | Failure]:
        return self._map("complete", texts, gen)

    def submit(self, key, kind: str, payload, gen: Generation) -> None:
        if self._stream_pool is None:
            self._stream_pool = ThreadPoolExecutor(max_workers=self.workers)
        i, self._submitted = self._submitted, self._submitted + 1  # spreads requests over endpoints
        self._futures[self._stream_pool.submit(self._one, i, kind, payload, gen)] = key

    def poll(self) -> list[tuple[object, Completion | Failure]]:
        if not self._futures:
            return []
        done, _ = wait(self._futures, return_when=FIRST_COMPLETED)
        return [(self._futures.pop(f), f.result()) for f in done]  # a ConfigError re-raises here

    def cancel(self) -> None:
        for f in self._futures:
            f.cancel()
        self._futures.clear()

    def close(self) -> None:
        if self._stream_pool is not None:
            self._stream_pool.shutdown(wait=True, cancel_futures=True)
            self._stream_pool = None
