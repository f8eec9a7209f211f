"""Sixth QA pass of ``ingest``'s data path: an endpoint answering 200 with a body of the wrong shape,
prompt text rewritten by the identity normalisation, chat roles no template knows. Pure functions and
a tiny loopback HTTP server; no vLLM engine."""

from __future__ import annotations

import contextlib
import http.server
import json
import shutil
import threading

import pytest
from ingest_helpers import Scripted

from eaglenest.config import build as build_cfg
from eaglenest.errors import ManifestError
from eaglenest.hf import load_tokenizer
from eaglenest.ingest import backends
from eaglenest.ingest.build import build
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Generation, Manifest, Source
from eaglenest.ingest.pool import PoolEntry, build_pool, load_source


def _manifest(**top) -> Manifest:
    return build_cfg(Manifest, {"name": "t", "licence": "x", "raw_fraction": 0.0, "held_out_fraction": 0.0, **top,
                            "domains": {"a": {"cap_prompts": 100, "sources": [{"path": "x", "provenance": "p"}]}}})


# -- an endpoint whose 200 answer is not a completion ---------------------------------------------------------
class _Answers(http.server.BaseHTTPRequestHandler):
    """A loopback server that lists one model and answers every POST with ``server.body`` (HTTP 200)."""

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(b'{"data": [{"id": "m"}]}')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(self.server.body)

    def log_message(self, *args):
        pass


_CHAT = [{"role": "user", "content": "hello"}]


@contextlib.contextmanager
def _endpoint(handler, target, *, body: bytes = b"", max_retries: int = 0):
    """A local HTTP server answering with ``handler`` (``server.body``; requests kept in ``server.seen``)
    and an EndpointBackend on it: ``(server, url, backend)``, both closed after."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.body, httpd.seen = body, []
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    backend = backends.EndpointBackend([url], target=str(target), max_retries=max_retries, backoff_s=0, timeout_s=10)
    try:
        yield httpd, url, backend
    finally:
        backend.close()
        httpd.shutdown()
_BAD_BODIES = [
    ("chat", {"choices": [{"message": None, "token_ids": [1], "finish_reason": "stop"}], "prompt_token_ids": [1]}),
    ("raw", {"choices": [[1, 2]], "prompt_token_ids": [1]}),
    ("raw", {"choices": [{"text": "hi", "token_ids": ["a", None], "finish_reason": "stop"}], "prompt_token_ids": [1]}),
    ("raw", {"choices": [{"text": "hi", "token_ids": [1], "finish_reason": "stop"}], "prompt_token_ids": "12"}),
    ("raw", {"choices": [{"text": 5, "token_ids": [1], "finish_reason": "stop"}], "prompt_token_ids": [1]}),
    ("raw", "deep"),
]


@pytest.mark.parametrize("kind, body", _BAD_BODIES)
def test_an_endpoint_answer_of_the_wrong_shape_is_a_failed_request(tiny_target, kind, body):
    # A 200 answer whose message was null, whose choice was a list, or nested past the JSON parser's depth
    # raised AttributeError / RecursionError out of the request's thread: `ingest build` ended in a
    # traceback. Token ids that were not integers (["a", null], the string "12") were stored as a
    # Completion and failed later, in the Arrow write of the whole shard.
    answer = b"[" * 100_000 + b"]" * 100_000 if body == "deep" else json.dumps(body).encode()
    with _endpoint(_Answers, tiny_target, body=answer, max_retries=1) as (_, url, backend):
        backend.submit("k", kind, _CHAT if kind == "chat" else "hello", Generation())
        ((key, result),) = backend.poll()
    assert key == "k" and isinstance(result, backends.Failure), result
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    assert result.error.startswith(f"2 attempt(s) failed; last: {url}{path}: "), result.error
    assert "\n" not in result.error and len(result.error) < 400


def test_a_well_formed_endpoint_answer_is_still_a_completion(tiny_target):
    answer = json.dumps({"choices": [{"text": "hi", "token_ids": [7, 8], "finish_reason": "length"}],
                         "prompt_token_ids": [1, 2, 3]}).encode()
    with _endpoint(_Answers, tiny_target, body=answer) as (_, _url, backend):
        backend.submit("k", "raw", "hello", Generation())
        ((_, result),) = backend.poll()
    assert result == backends.Completion([1, 2, 3], [7, 8], "hi", "length")


# -- the text the target answers is the text the source holds ---------------------------------------------------
def test_compatibility_forms_in_a_prompt_reach_the_target_unchanged():
    # NFKC, the identity's normalisation, was applied to the text sent too: "x² + y² = 5²" went to the
    # target as "x2 + y2 = 52", "½" as "1⁄2" and "①" as "1": another question, answered and trained on.
    rows = [{"prompt": "  Solve x² + y² = 5² for ½ of ①.\r\nThanks  ", "system": "Be brief™ ", "source": "s"}]
    (entry,) = build_pool(_manifest(), {"a": rows})
    assert entry.prompt == "Solve x² + y² = 5² for ½ of ①.\nThanks"  # newlines unified, lines trimmed
    assert entry.system == "Be brief™"


def test_compatibility_forms_keep_the_sample_id_and_stay_one_prompt():
    # The identity still folds compatibility forms, so ids of stored prompts do not change and
    # "x²" / "x2" twins stay exact duplicates (the first one read is kept).
    plain = build_pool(_manifest(), {"a": [{"prompt": "Solve x2 + y2 = 52", "system": "", "source": "s"}]})
    rows = [{"prompt": "Solve x² + y² = 5²", "system": "", "source": "s"},
            {"prompt": "Solve x2 + y2 = 52", "system": "", "source": "s"}]
    report: dict = {}
    (entry,) = build_pool(_manifest(), {"a": rows}, report=report)
    assert entry.sample_id == plain[0].sample_id == "a-" + _key("solve x2 + y2 = 52")[:16]
    assert entry.prompt == "Solve x² + y² = 5²"
    assert report["domains"]["a"]["exact_duplicates"] == 1


def test_canonically_equivalent_spellings_are_sent_composed():
    # "é" typed as e + a combining accent (NFD, macOS file names) and as one code point: one prompt,
    # sent in the composed form whichever the file holds.
    (entry,) = build_pool(_manifest(), {"a": [{"prompt": "Cafe\u0301 au lait?", "system": "", "source": "s"}]})
    assert entry.prompt == "Caf\u00e9 au lait?"


def _key(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


# -- roles no chat template knows --------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["human", "gpt", "User", "developer"])
def test_a_message_role_that_is_neither_user_system_assistant_nor_tool_is_refused(tmp_path, role):
    # A conversation written with {"role": "human"} / {"role": "gpt"} turns (ShareGPT's speakers under
    # OpenAI's keys) had no user turn: every such row was counted "empty" and silently left out of the
    # pool; a "developer" message (OpenAI's system prompt) was dropped without a word.
    path = tmp_path / "chats.jsonl"
    chats = [[{"role": "user", "content": "fine"}, {"role": "assistant", "content": "ok"}],
             [{"role": role, "content": "What is two plus two?"}, {"role": "assistant", "content": "4"}]]
    path.write_text("".join(json.dumps({"m": c}) + "\n" for c in chats))
    with pytest.raises(ManifestError) as exc:
        load_source(Source(path=str(path), messages_field="m"), where="domains.d.sources[0]")
    assert str(exc.value).startswith(f"domains.d.sources[0].messages_field: row 1 of {path}: message 0 has role "
                                     f"'{role}'"), str(exc.value)
    assert "user" in str(exc.value) and "\n" not in str(exc.value)


def test_tool_function_and_ipython_messages_are_still_read(tmp_path):
    path = tmp_path / "chats.jsonl"
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "call it"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": [{"type": "text", "text": "42"}]}, {"role": "function", "content": "x"},
            {"role": "ipython", "content": "y"}, {"role": "user", "content": "and now?"}]
    path.write_text(json.dumps({"m": chat}) + "\n")
    (row,) = load_source(Source(path=str(path), messages_field="m"), where="d")
    assert (row["system"], row["prompt"], row["later_turns"]) == ("S", "call it", ["and now?"])


# -- a template that refuses a long prompt, measured before the engine starts -------------------------------------
def test_a_long_prompt_the_template_refuses_is_left_to_the_engine_not_a_traceback(tmp_path, tiny_target):
    # A prompt of half of max_model_len bytes or more is rendered before any engine starts, to leave out
    # what the engine could never take. A template that refuses it (Gemma's "System role not supported",
    # raise_exception) raised jinja's TemplateError out of `ingest build`: a traceback, nothing stored.
    # Short prompts of the same chat were sent, and the engine refused them one by one, reported.
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                            "supported') }}{% endif %}" + cfg["chat_template"])
    (target / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_tokenizer(str(target), trust_remote_code=False)
    entries = [PoolEntry(sample_id=f"d-{i:016x}", domain="d", source="s", split="train", mode="chat",
                         system="Be brief.", prompt="word " * (60 * i + 1)) for i in (0, 1)]
    backend = Scripted(tok)
    stats = build(_manifest(), entries, target=str(target), store_uri=str(tmp_path / "store"), backend=backend,
                  cfg=build_cfg(IngestConfig, {"engine": {"max_model_len": 128}}))
    assert sorted(backend.requests) == [e.sample_id for e in entries]  # both sent: the engine decides
    assert stats["prompt_too_long"]["dropped"] == 0 and stats["regenerated"] == 2


def test_an_answer_from_another_model_than_the_one_asked_for_is_a_failed_request(tiny_target):
    # A router in front of the servers (a fallback to another deployment) or a server whose model was
    # swapped between /v1/models and the request answered as "other-model": the answer was stored as the
    # target's own, on-policy, and trained on. vLLM echoes the model it was asked for.
    answer = json.dumps({"model": "other-model", "prompt_token_ids": [1, 2],
                         "choices": [{"text": "hi", "token_ids": [7], "finish_reason": "stop"}]}).encode()
    with _endpoint(_Answers, tiny_target, body=answer) as (httpd, url, backend):
        backend.submit("k", "raw", "hello", Generation())
        ((_, result),) = backend.poll()
        httpd.body = httpd.body.replace(b'"other-model"', b'"m"')  # the model listed by /v1/models: accepted
        backend.submit("k2", "raw", "hello", Generation())
        ((_, same),) = backend.poll()
    assert isinstance(result, backends.Failure), result
    assert result.error == (f"1 attempt(s) failed; last: {url}/v1/completions: answered by model 'other-model', "
                            "not 'm' (the model the server lists and was asked for)")
    assert same == backends.Completion([1, 2], [7], "hi", "stop")


# -- endpoints sample as the in-process engine does ------------------------------------------------------------
class _Records(_Answers):
    """Answers like :class:`_Answers` and keeps each request body in ``server.seen``."""

    def do_POST(self):
        self.server.seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self._send(self.server.body)


#: What vLLM's OpenAI server takes from the target's generation_config.json for a request that leaves it
#: out (ModelConfig.get_diff_sampling_param; Qwen3 ships top_p 0.95, top_k 20, ...).
_SERVER_DEFAULTED = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                     "min_p", "max_tokens")


@pytest.mark.parametrize("kind", ["raw", "chat"])
def test_endpoint_requests_sample_as_the_in_process_engine_does(tiny_target, kind):
    # The body named temperature, max_tokens and seed only: a vLLM server fills every other sampling
    # parameter from the target's generation_config.json (top_p, top_k, min_p, repetition_penalty), the
    # in-process engine (explicit SamplingParams) does not. Rows of the two backends were sampled
    # differently under one gen_params_id (a repetition_penalty changes even greedy answers) and mixed.
    from vllm import SamplingParams

    answer = json.dumps({"model": "m", "prompt_token_ids": [1], "choices": [
        {"text": "hi", "message": {"content": "hi"}, "token_ids": [7], "finish_reason": "stop"}]}).encode()
    gen = Generation(temperature=0.7, max_tokens=9, seed=3)
    with _endpoint(_Records, tiny_target, body=answer) as (httpd, _url, backend):
        backend._checked.add(backend.urls[0])  # the template check is another test's (the ids here are made up)
        backend.submit("k", kind, _CHAT if kind == "chat" else "hello", gen)
        backend.poll()
    (body,) = httpd.seen
    assert set(_SERVER_DEFAULTED) <= set(body), sorted(body)
    local = SamplingParams(temperature=gen.temperature, max_tokens=gen.max_tokens, seed=gen.seed)  # LocalBackend's
    sent = SamplingParams(seed=body["seed"], **{k: body[k] for k in _SERVER_DEFAULTED})
    assert {k: getattr(sent, k) for k in _SERVER_DEFAULTED} == {k: getattr(local, k) for k in _SERVER_DEFAULTED}


class _DeepModels(_Answers):
    def do_GET(self):
        self._send(b"[" * 100_000 + b"]" * 100_000)


def test_a_model_list_nested_past_the_parsers_depth_is_a_failed_request(tiny_target):
    # /v1/models nested past the JSON parser's depth raised RecursionError out of the request's thread.
    with _endpoint(_DeepModels, tiny_target) as (_, url, backend):
        backend.submit("k", "raw", "hello", Generation())
        ((_, result),) = backend.poll()
    assert result == backends.Failure(f"1 attempt(s) failed; last: {url}/v1/models: RecursionError")
