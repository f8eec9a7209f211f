"""Sixth QA pass of ``ingest``'s data path: an endpoint answering 200 with a body of the wrong shape,
prompt text rewritten by the identity normalisation, chat roles no template knows. Then the manifest and
the prompt pool as a user's own domains meet them: `ingest validate` beside a manifest's own problem,
domains sharing prompts under changed caps, token caps, save_to_disk folders, suffixes in capitals,
UTF-16 files. Pure functions, a scripted backend and a tiny loopback HTTP server; no vLLM engine."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from ingest_helpers import Answers as _Answers, Scripted, endpoint as _endpoint

from eaglenest.config import build as build_cfg
from eaglenest.errors import ManifestError
from eaglenest.hf import load_tokenizer
from eaglenest.ingest import backends
from eaglenest.ingest.build import build
from eaglenest.ingest.cli import main
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import Generation, Manifest, Source, check
from eaglenest.ingest.pool import PoolEntry, build_pool, load_source, token_counter


def _manifest(**top) -> Manifest:
    return build_cfg(Manifest, {"name": "t", "licence": "x", "raw_fraction": 0.0, "held_out_fraction": 0.0, **top,
                            "domains": {"a": {"cap_prompts": 100, "sources": [{"path": "x", "provenance": "p"}]}}})


# -- an endpoint whose 200 answer is not a completion ---------------------------------------------------------
_CHAT = [{"role": "user", "content": "hello"}]


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


# == the prompt pool and the manifest as a user's own domains meet them ==========================================
def _domains_manifest(caps: dict, **top) -> Manifest:
    return build_cfg(Manifest, {"name": "t", "licence": "x", "raw_fraction": 0.0, "held_out_fraction": 0.0, **top,
                                "domains": {d: {**cap, "sources": [{"path": "x", "provenance": "p"}]}
                                            for d, cap in caps.items()}})


def _rows(prompts) -> list[dict]:
    return [{"prompt": p, "system": "", "source": "s"} for p in prompts]


def test_validate_reads_the_sources_beside_a_problem_of_the_manifest(tmp_path, capsys):
    # A manifest with one problem of its own (a cap of 0) had its sources left unread: `ingest validate`
    # listed the cap alone, and the source without the 'prompt' column and the file that is not UTF-8
    # came out one run later; the docs promise every problem in one run.
    (tmp_path / "nocol.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "latin.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    m = tmp_path / "m.yaml"
    m.write_text(f"name: t\nlicence: x\ndomains:\n  a:\n    cap_prompts: 0\n    sources:\n"
                 f"      - {{path: {tmp_path}/nocol.jsonl, provenance: p}}\n"
                 f"      - {{path: {tmp_path}/missing.jsonl, provenance: p}}\n"
                 f"  b:\n    cap_prompts: 2\n    sources: [{{path: {tmp_path}/latin.jsonl, provenance: p}}]\n")
    assert main(["validate", "--manifest", str(m)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["domains.a.cap_prompts: must be at least 1",
                     f"domains.a.sources[1].path: file not found: {tmp_path}/missing.jsonl",  # once, not read again
                     f"domains.a.sources[0].field: row 0 of {tmp_path}/nocol.jsonl has no column 'prompt'",
                     f"domains.b.sources[0].path: {tmp_path}/latin.jsonl line 1 is not UTF-8 text (byte 15; "
                     "binary file?)",
                     f"ingest: error: {m}: 4 problem(s)"]


def test_a_prompt_a_domains_cap_leaves_out_is_not_passed_to_a_later_domain():
    # Two domains sharing prompts: the first listed owns them. A prompt its cap left out went to the later
    # domain instead, so the owner of a prompt depended on the caps (next test: a changed cap was refused).
    shared = [f"shared question {i}" for i in range(6)]
    loaded = {"a": _rows(shared), "b": _rows([f"own question {i}" for i in range(6)] + shared)}
    for cap in (1, 3, 6):
        report: dict = {}
        pool = build_pool(_domains_manifest({"a": {"cap_prompts": cap}, "b": {"cap_prompts": 20}}), loaded,
                          report=report)
        assert sorted(e.prompt for e in pool if e.domain == "b") == [f"own question {i}" for i in range(6)], cap
        assert sum(e.domain == "a" for e in pool) == cap
        assert report["domains"]["b"]["exact_duplicates"] == 6


@pytest.mark.parametrize("caps", [(2, 6), (6, 2)], ids=["raised", "lowered"])
def test_a_rerun_with_a_changed_cap_keeps_each_stored_prompt_in_its_domain(tmp_path, tiny_target, caps):
    # Raising domain a's cap (2 -> 6) or lowering it (6 -> 2) when domain b's source shares a's prompts was
    # refused: "4 prompt(s) of domain 'a' are stored already under domain 'b' (a renamed domain, or a source
    # moved ...)", neither of which happened. The docs: a cap raised adds prompts; a cap lowered keeps the
    # stored ones, counted in not_in_pool.
    shared = [f"shared question {i}" for i in range(6)]
    loaded = {"a": _rows(shared), "b": _rows([f"own question {i}" for i in range(6)] + shared)}
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    store_uri, cfg = str(tmp_path / "store"), build_cfg(IngestConfig, {})
    stats = []
    for cap in caps:
        m = _domains_manifest({"a": {"cap_prompts": cap}, "b": {"cap_prompts": 20}})
        stats.append(build(m, build_pool(m, loaded), target=str(tiny_target), store_uri=store_uri,
                           backend=Scripted(tok), cfg=cfg))
    first, second = stats
    assert first["counts"] == {"a/train": caps[0], "b/train": 6}
    assert second["counts"] == {"a/train": max(caps), "b/train": 6}  # every row once, in its own domain
    assert second["regenerated"] == max(caps) - caps[0]
    assert second["not_in_pool"] == ({"prompts": 4, "per_domain": {"a": 4}} if caps[0] > caps[1]
                                     else {"prompts": 0, "per_domain": {}})


def test_a_token_cap_counts_the_prompt_not_a_newline_before_it(tiny_target):
    # A prompt without a system prompt was counted as "\n" + prompt: one token more each, so a domain with
    # cap_tokens kept fewer prompts than fit (7 of these 9 seven-token prompts under cap_tokens: 63).
    count = token_counter(str(tiny_target))
    prompts = [f"What is {i}+{i}?" for i in range(1, 10)]  # 7 tokens each, without a system prompt
    assert {count(p) for p in prompts} == {7}
    m = _domains_manifest({"a": {"cap_tokens": 7 * len(prompts)}})
    pool = build_pool(m, {"a": _rows(prompts)}, count_tokens=count)
    assert sorted(e.prompt for e in pool) == sorted(prompts)
    system = [{**r, "system": "Be brief."} for r in _rows(prompts)]  # a system prompt counts, and its "\n"
    pool = build_pool(m, {"a": system}, count_tokens=count)
    assert len(pool) == 7 * len(prompts) // count("Be brief.\nWhat is 1+1?")


def test_a_dataset_folder_written_by_save_to_disk_is_a_source(tmp_path):
    # `hf_id: ./folder` of a Dataset.save_to_disk was refused: "cannot load ... (You are trying to load a
    # dataset that was saved using `save_to_disk`. Please use `load_from_disk` instead.)", advice no
    # manifest key can follow.
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_list([{"prompt": "first one"}, {"prompt": "second one"}]).save_to_disk(str(folder))
    rows = load_source(Source(hf_id=str(folder), provenance="p"), where="domains.d.sources[0]")
    assert [r["prompt"] for r in rows] == ["first one", "second one"]
    assert {r["source"] for r in rows} == {f"hf:{folder}"}


@pytest.mark.parametrize("name", ["PROMPTS.JSONL", "prompts.Parquet", "prompts.JSON"])
def test_a_source_suffix_in_capitals_is_its_format(tmp_path, name):
    # "PROMPTS.JSONL" (a Windows export) was refused by validate with ".JSONL is not .jsonl, .json or
    # .parquet", and read by build as one JSON document ("not valid JSON ... Extra data").
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "first one"}, {"prompt": "second one"}]
    path = tmp_path / name
    if name.endswith("Parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text(json.dumps(rows) if name.endswith("JSON") else "".join(json.dumps(r) + "\n" for r in rows))
    m = _domains_manifest({"a": {"cap_prompts": 5}})
    src = Source(path=str(path), provenance="p")
    assert check(dataclasses.replace(m, domains={"a": dataclasses.replace(m.domains["a"], sources=[src])})) == []
    assert [r["prompt"] for r in load_source(src, where="domains.a.sources[0]")] == ["first one", "second one"]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be"])
def test_a_utf16_source_says_so_rather_than_binary(tmp_path, encoding):
    # Windows PowerShell's `>` and Notepad's "Unicode" write UTF-16 with a byte-order mark: the line said
    # "line 1 is not UTF-8 text (byte 0; binary file?)", pointing at a binary file that the user can read.
    path = tmp_path / "prompts.jsonl"
    data = '{"prompt": "hello"}\n'.encode(encoding)
    path.write_bytes(data if encoding == "utf-16" else b"\xfe\xff" + data)
    with pytest.raises(ManifestError) as exc:
        load_source(Source(path=str(path)), where="domains.a.sources[0]")
    assert str(exc.value) == f"domains.a.sources[0].path: {path} is UTF-16 text, not UTF-8; save it as UTF-8"


def test_a_binary_file_that_starts_like_utf16_is_still_not_utf8(tmp_path):
    # Bytes FF FE are a UTF-16 byte-order mark only when the rest decodes as UTF-16.
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\xff\xfe" + bytes(range(256)) * 4)  # a lone surrogate early on: no UTF-16 text
    with pytest.raises(ManifestError, match=r"^domains\.a\.sources\[0\]\.path: .* line 1 is not UTF-8 text \(byte 0;"):
        load_source(Source(path=str(path)), where="domains.a.sources[0]")


def test_a_glob_as_a_source_path_says_paths_are_not_globs(tmp_path):
    # `path: data/*.jsonl` with data/a.jsonl and data/b.jsonl there said "file not found: data/*.jsonl",
    # beside the very files the user meant.
    (tmp_path / "a.jsonl").write_text('{"prompt": "x"}\n')
    m = _domains_manifest({"a": {"cap_prompts": 5}})
    src = Source(path=str(tmp_path / "*.jsonl"), provenance="p")
    problems = check(dataclasses.replace(m, domains={"a": dataclasses.replace(m.domains["a"], sources=[src])}))
    assert problems == [f"domains.a.sources[0].path: file not found: {tmp_path}/*.jsonl (a path is one file, not a "
                        "glob: list each file)"]
