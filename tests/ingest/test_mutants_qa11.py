"""Second mutation audit of ingest: regeneration, backends, think tags, near duplicates, composition, the
manifest. Each test checks a documented behaviour from first principles (a reference computed here, an
invariant, a round trip); no engine (the scripted backend of ingest_helpers.py, or none)."""

from __future__ import annotations

import json
import shutil
import zlib

import numpy as np
import pytest

from eaglenest.config import build as build_cfg
from eaglenest.featurestore.table import store
from eaglenest.engine import EngineConfig
from eaglenest.errors import ConfigError
from eaglenest.hf import load_tokenizer
from eaglenest.ingest import compose, dask_executor
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.backends import EndpointBackend, LocalBackend
from eaglenest.ingest.build import build
from eaglenest.ingest.manifest import Generation, Manifest, Source
from eaglenest.ingest.neardup import NearDupIndex, lsh_params, shingles
from eaglenest.ingest.pool import PoolEntry, build_pool, load_source, raw_text
from eaglenest.ingest.reasoning import DEFAULT_TAGS, ThinkCheck, resolve_tags
from eaglenest.ingest.regen import THINKING_TRUNCATED, regenerate

from ingest_helpers import Scripted  # tests/ingest on sys.path via conftest


def _entry(i: int, prompt: str, *, mode: str = "chat", later: tuple[str, ...] = (), system: str = "") -> PoolEntry:
    return PoolEntry(sample_id=f"d-{i:016x}", domain="d", source="s", split="train", mode=mode, system=system,
                     prompt=prompt, later_turns=later)


def test_a_raw_completion_cut_off_after_a_think_tag_is_kept(tiny_target):
    # docs/ingest.md: a *chat* answer cut off inside an open think block is dropped; a raw completion has no
    # chat template and no thinking mode, so "<think>" in a document's continuation is text like any other.
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    check = ThinkCheck(*DEFAULT_TAGS, target=str(tiny_target))
    entries = [_entry(0, "please think it over", mode="raw"), _entry(1, "please think it over too")]
    dropped: list = []
    rows, failures = regenerate(Scripted(tok), entries, Generation(), "g", think=check, dropped=dropped)
    assert failures == []
    assert [r["sample_id"] for r in rows] == [entries[0].sample_id]
    assert rows[0]["finish_reason"] == "length" and rows[0]["mode"] == "raw"
    assert dropped == [{"sample_id": entries[1].sample_id, "domain": "d", "reason": str(THINKING_TRUNCATED)}]


class _LastFirst(Scripted):
    """The scripted backend, answering the requests queued since the last poll last first (a long prompt that
    an engine finishes after a short one queued behind it)."""

    finished: list = []

    def poll(self):
        out = list(reversed(super().poll()))
        self.finished = [*self.finished, *(key for key, _ in out)]
        return out


def test_a_shards_rows_are_in_entry_order_whatever_order_the_answers_finish_in(tiny_target):
    # regenerate(): "rows for the prompts table in entry order", so a shard's fragment is the same on every run
    # and on every executor, however the engine schedules the requests.
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    entries = [_entry(i, f"question number {i}", mode="raw" if i % 3 == 0 else "chat") for i in range(10)]
    backend = _LastFirst(tok)
    rows, failures = regenerate(backend, entries, Generation(), "g")
    assert failures == [] and backend.finished != [e.sample_id for e in entries]  # they did finish out of order
    assert [r["sample_id"] for r in rows] == [e.sample_id for e in entries]


#: What a vLLM server fills from the target's generation_config.json when a request leaves it out
#: (docs/ingest.md: "top_p, top_k, min_p, the penalties"), besides temperature and max_tokens.
SERVER_DEFAULTED = ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def test_both_backends_sample_with_the_same_parameters(tiny_target):
    # Rows of both backends share one gen_params_id, so an endpoint request must carry every sampling value the
    # in-process engine uses: the generation's own (a dropped seed makes temperature > 0 answers unrepeatable)
    # and vLLM's neutral value for each one a server would otherwise take from generation_config.json.
    from vllm import SamplingParams

    gen = Generation(temperature=0.7, max_tokens=33, seed=1234)
    local = LocalBackend(None, max_in_flight=1)._params(gen)
    body = EndpointBackend(["http://127.0.0.1:9"], target=str(tiny_target))._sampling(gen)
    neutral = SamplingParams()
    assert (local.temperature, local.max_tokens, local.seed) == (0.7, 33, 1234)
    assert (body["temperature"], body["max_tokens"], body["seed"]) == (0.7, 33, 1234)
    for key in SERVER_DEFAULTED:
        assert body[key] == getattr(local, key) == getattr(neutral, key), key
    assert body["skip_special_tokens"] == local.skip_special_tokens  # the same answer text


def test_a_dask_workers_warm_backend_renders_with_this_builds_template_kwargs(tiny_target, monkeypatch):
    # A worker keeps its backend for later builds with the same settings: one kept across a change of
    # ingest.chat_template_kwargs would render every chat with the old kwargs under the new gen_params_id.
    monkeypatch.setattr(dask_executor, "_BACKENDS", {})
    made = {}
    for thinking in (True, False, True):
        cfg = IngestConfig(backend="endpoints", endpoints=["http://127.0.0.1:9"],  # HTTP clients: no engine
                           chat_template_kwargs={"enable_thinking": thinking})
        backend = dask_executor._backend(cfg, str(tiny_target), False)
        assert backend.chat_template_kwargs == {"enable_thinking": thinking}
        made.setdefault(thinking, []).append(backend)
    assert made[True][0] is not made[False][0]
    assert len(dask_executor._BACKENDS) == 1  # one backend per worker at a time


class _Recording(Scripted):
    """The scripted backend, keeping each request's kind and payload by key."""

    def submit(self, key, kind, payload, gen):
        self.sent = {**getattr(self, "sent", {}), key: (kind, json.loads(json.dumps(payload)))}
        super().submit(key, kind, payload, gen)


def test_a_raw_request_sends_the_system_prompt_a_blank_line_and_the_prompt(tiny_target):
    # docs/manifest.md: a raw prompt is sent as a plain document, its system prompt first (evaluate decodes a
    # raw held-out prompt the same way), and the row keeps the document it was sent.
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    entry = _entry(0, "What is 2 + 2?", mode="raw", system="Answer with a number.")
    backend = _Recording(tok)
    (row,), _ = regenerate(backend, [entry], Generation(), "g")
    sent = ("raw", "Answer with a number.\n\nWhat is 2 + 2?\n")
    assert backend.sent[entry.sample_id] == sent == ("raw", raw_text(entry))
    document, answer = json.loads(row["messages_json"])
    assert document == {"role": "document", "content": raw_text(entry)} and answer["role"] == "assistant"
    assert row["prompt_token_ids"] == tok(raw_text(entry))["input_ids"]  # the scripted backend tokenizes what it got


@pytest.mark.parametrize("chunk, words", [(None, 9000), (3, 60)])
def test_a_minhash_signature_is_the_least_hash_of_every_shingle_even_past_a_chunk(monkeypatch, chunk, words):
    # neardup.py: signature[j] = min over the text's shingles of (a_j * crc32(shingle) + b_j) mod (2**32 + 15);
    # recomputed here with Python integers, over more shingles than one signing chunk holds (the real chunk,
    # and a chunk of 3 so that every shingle at a chunk's edge is some permutation's minimum).
    from eaglenest.ingest import neardup

    if chunk is not None:
        monkeypatch.setattr(neardup, "_CHUNK", chunk)
    index = NearDupIndex(0.8, num_perm=128, shingle_words=2)
    text = " ".join(f"w{i}" for i in range(words))
    sh, sig = index.sketch(text)
    assert sh == shingles(text, 2) and len(sh) == words - 1
    p = (1 << 32) + 15
    hashes = [zlib.crc32(s.encode()) for s in sh]
    want = [min((int(a) * x + int(b)) % p for x in hashes) for a, b in zip(index._a, index._b)]
    assert sig.tolist() == want


def test_texts_sharing_only_their_last_band_are_candidates():
    # LSH banding: two texts whose signatures agree on every row of *any* band are candidates (then the exact
    # Jaccard decides). Signatures agreeing on the last band alone, over the same shingles, must be found.
    index = NearDupIndex(0.8)
    sh = shingles("one two three four five six seven eight nine ten", 5)
    rows, bands = index.rows, index.bands
    mine = np.arange(1, index._a.size + 1, dtype=np.uint64)
    other = mine + np.uint64(1000)
    last = slice((bands - 1) * rows, bands * rows)
    other[last] = mine[last]
    index.add("kept", (sh, mine))
    assert index.find((sh, other)) == "kept"
    first = slice(0, rows)
    other = mine + np.uint64(1000)
    other[first] = mine[first]
    assert index.find((sh, other)) == "kept"
    assert index.find((sh, mine + np.uint64(1000))) is None  # no band shared: not a candidate


def test_the_banding_makes_pairs_above_the_threshold_candidates_and_pairs_far_below_rarely():
    # The S-curve of (bands, rows): a pair of similarity s is a candidate with p = 1 - (1 - s**rows)**bands.
    # Tuned to weigh misses above the threshold 8x: most pairs at the threshold are candidates, few far below.
    for threshold in (0.5, 0.8, 0.9):
        bands, rows = lsh_params(threshold, 128)
        assert bands * rows <= 128
        p = lambda s: 1.0 - (1.0 - s ** rows) ** bands  # noqa: E731
        assert p(threshold) >= 0.75 and p(min(1.0, threshold + 0.1)) >= 0.97, (threshold, bands, rows)
        assert p(threshold - 0.4) <= 0.05, (threshold, bands, rows)


def test_the_generated_tokens_of_a_build_are_the_response_tokens_it_stored(tmp_path, tiny_target):
    # stats.generated_tokens (and each shard's tokens/s) counts what the target generated: the stored rows'
    # response tokens, not their prompts.
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    m = build_cfg(Manifest, {"name": "t", "licence": "x", "domains": {
        "d": {"cap_prompts": 9, "sources": [{"path": "x", "provenance": "p"}]}}})
    entries = [_entry(i, f"a rather longer question, number {i}, to answer", mode="raw" if i % 2 else "chat")
               for i in range(7)]
    uri = str(tmp_path / "store")
    stats = build(m, entries, target=str(tiny_target), store_uri=uri, cfg=IngestConfig(commit_every=3),
                  backend=Scripted(tok))
    table = store.read(uri, store.PROMPTS, columns=["prompt_token_ids", "response_token_ids"]).to_pylist()
    assert stats["regenerated"] == len(table) == 7 and stats["shards"] == 3
    assert stats["generated_tokens"] == sum(len(r["response_token_ids"]) for r in table)
    assert stats["generated_tokens"] != sum(len(r["prompt_token_ids"]) for r in table)


def test_a_long_generation_prompt_that_opens_a_think_block_is_seen_at_its_end(tiny_target):
    # The block may be opened by the generation prompt itself (Qwen3 / DeepSeek-R1 templates end it with
    # "<think>\n"): what counts is how the prompt *ends*, however long the conversation before it is.
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    check = ThinkCheck(*DEFAULT_TAGS, target=str(tiny_target))

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    history = " ".join(f"earlier turn number {i} of a long conversation" for i in range(40))
    words = ids("first, add the two numbers")
    assert len(ids(history)) > 200
    assert check.truncated(ids(history + "<|assistant|>\n<think>\n"), words, "length")
    # a user who wrote "<think>" at the start of a long prompt opens no block at its end
    assert not check.truncated(ids("<think>\n" + history + "<|assistant|>\n"), words, "length")
    for reason in ("stop", "", "abort"):  # only a max_tokens cut-off (finish reason length) is truncated
        assert not check.truncated(ids(history + "<|assistant|>\n<think>\n"), words, reason), reason


@pytest.mark.parametrize("tags", [["<think>", "<think>"], ["<think>", ""], ["<a>", "<b>", "<c>"]])
def test_think_tags_are_two_different_non_empty_tags(tags):
    # The same tag twice opens and closes at the same place: no answer would ever count as cut off in its block.
    with pytest.raises(ConfigError, match=r"^ingest\.think_tags: two different, non-empty tags \[open, close\]"):
        IngestConfig(think_tags=tags)


def test_the_longest_composed_conversation_counts_its_last_answer():
    # docs/manifest.md: a composed conversation is at most about its target "plus the last answer's max_tokens";
    # ingest build refuses a manifest whose longest one the engine's max_model_len cannot hold.
    def manifest(lengths_by_domain: dict, max_tokens: int) -> Manifest:
        return build_cfg(Manifest, {"name": "t", "licence": "x", "generation": {"max_tokens": max_tokens}, "domains": {
            d: {"cap_prompts": 9, "held_out_count": 0, "sources": [{"path": "x", "provenance": "p"}],
                "compose": {"rule": "long_chat", "target_tokens": lengths}}
            for d, lengths in lengths_by_domain.items()}})

    assert compose.longest_tokens(manifest({"a": [2048, 512], "b": [1024]}, 160)) == 2048 + 160
    assert compose.longest_tokens(manifest({"a": [300]}, 1)) == 301


def test_a_reused_engine_samples_each_request_with_its_own_generation_settings():
    # A Dask worker keeps its engine for later builds with the same ingest settings, but the sampling comes
    # from each manifest's generation: a build with another max_tokens or seed must not reuse the first's.
    backend = LocalBackend(None, max_in_flight=1)
    for gen in (Generation(max_tokens=7), Generation(max_tokens=50, seed=3), Generation(temperature=0.5, seed=3),
                Generation(max_tokens=7)):
        params = backend._params_for(gen)  # what submit() hands vLLM
        assert (params.temperature, params.max_tokens, params.seed) == (gen.temperature, gen.max_tokens, gen.seed)


def test_the_suffix_of_the_path_as_written_decides_the_format_before_the_linked_files(tmp_path):
    # docs/manifest.md: "The suffix of path as written decides the format ..., else that of the file it links to".
    blob = tmp_path / "blob.json"  # JSONL lines in a file whose own name says .json
    blob.write_text('{"prompt": "first one"}\n{"prompt": "second one"}\n')
    link = tmp_path / "prompts.jsonl"
    link.symlink_to(blob)
    rows = load_source(Source(path=str(link), provenance="p"), where="domains.d.sources[0]")
    assert [r["prompt"] for r in rows] == ["first one", "second one"]
    cached = tmp_path / "snapshot.jsonl"  # the Hugging Face cache's case: a blob without a suffix
    (tmp_path / "0a1b2c").write_text('{"prompt": "third one"}\n')
    cached.symlink_to(tmp_path / "0a1b2c")
    assert [r["prompt"] for r in load_source(Source(path=str(cached), provenance="p"), where="w")] == ["third one"]


def test_an_answer_that_opens_a_second_think_block_and_is_cut_off_in_it_is_truncated(tiny_target):
    # What counts is the *last* tag the answer wrote: a closed block, an answer, then a new block cut off by
    # max_tokens ends inside thinking; a block closed after an earlier open one does not.
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    check = ThinkCheck(*DEFAULT_TAGS, target=str(tiny_target))

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt = ids("<|user|>\nWhat is 2 + 2?<|assistant|>\n")
    assert check.truncated(prompt, ids("<think>add</think>It is 4. <think>but let me check again"), "length")
    assert not check.truncated(prompt, ids("<think>add <think>nested</think>It is"), "length")


def test_a_template_naming_one_tag_of_a_pair_does_not_choose_that_pair(tmp_path, tiny_target):
    # docs/ingest.md: the tags are the first known *pair* the chat template or added tokens contain. A template
    # that only mentions "<reasoning>" (a system instruction) must not make "</reasoning>" the close tag.
    root = tmp_path / "target"
    shutil.copytree(tiny_target, root)
    cfg = json.loads((root / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{# answers may quote <reasoning> sections #}" + cfg["chat_template"]
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert resolve_tags([], load_tokenizer(root, trust_remote_code=False)) == DEFAULT_TAGS
    cfg["chat_template"] += "{# and close them with </reasoning> #}"
    (root / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert resolve_tags([], load_tokenizer(root, trust_remote_code=False)) == ("<reasoning>", "</reasoning>")


def test_an_answer_dropped_for_truncated_thinking_is_not_asked_again_under_the_same_settings(tmp_path, tiny_target):
    # docs/ingest.md: a chat answer cut off inside an open think block is dropped and recorded under the run's
    # gen_params_id; later runs with the same generation settings skip it (no request), new settings retry it.
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    m = build_cfg(Manifest, {"name": "t", "licence": "x", "domains": {
        "d": {"cap_prompts": 9, "sources": [{"path": "x", "provenance": "p"}]}}})
    entries = [_entry(0, "please think about it"), _entry(1, "a plain question")]
    uri, record = str(tmp_path / "store"), tmp_path / "ingest" / "thinking_truncated.json"
    first = Scripted(tok)
    stats = build(m, entries, target=str(tiny_target), store_uri=uri, cfg=IngestConfig(), backend=first,
                  dropped_path=record)
    assert stats["thinking_truncated"]["dropped"] == 1
    assert sorted(first.requests) == sorted(e.sample_id for e in entries)
    again = Scripted(tok)
    stats = build(m, entries, target=str(tiny_target), store_uri=uri, cfg=IngestConfig(), backend=again,
                  dropped_path=record)
    assert again.requests == [] and stats["thinking_truncated"]["skipped_from_earlier_runs"] == 1
    longer = build_cfg(Manifest, {"name": "t", "licence": "x", "generation": {"max_tokens": 400}, "domains": {
        "d": {"cap_prompts": 9, "sources": [{"path": "x", "provenance": "p"}]}}})
    retried = Scripted(tok)
    build(longer, entries, target=str(tiny_target), store_uri=uri, cfg=IngestConfig(), backend=retried,
          dropped_path=record)
    assert retried.requests == [entries[0].sample_id]  # another gen_params_id: tried again


def test_a_multi_turn_conversation_is_always_chat_even_where_every_prompt_is_raw():
    # docs/manifest.md: multi-turn sources "are always regenerated as chat"; raw_fraction 1.0 makes every
    # *single-turn* training prompt raw (a raw completion holds one prompt, no turns).
    m = build_cfg(Manifest, {"name": "t", "licence": "x", "raw_fraction": 1.0, "held_out_fraction": 0.0, "domains": {
        "d": {"cap_prompts": 100, "sources": [{"path": "x", "provenance": "p"}]}}})
    rows = [{"prompt": f"question {i}", "later_turns": [f"and a follow-up {i}"] if i % 2 else [], "system": "",
             "source": "s"} for i in range(20)]
    pool = build_pool(m, {"d": rows})
    assert len(pool) == 20
    assert {e.mode for e in pool if e.later_turns} == {"chat"}
    assert {e.mode for e in pool if not e.later_turns} == {"raw"}


def test_a_chat_prompt_of_exactly_max_model_len_tokens_is_left_out_and_one_fewer_is_kept(tmp_path, tiny_target):
    # docs/ingest.md: a training prompt whose request, rendered by the chat template, "holds max_model_len tokens
    # or more" is left out (counted in stats.prompt_too_long); one token fewer still fits the engine.
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    entry = _entry(0, " ".join(f"word{i}" for i in range(40)), system="Be brief.")
    n = len(tok.apply_chat_template(entry.messages(), add_generation_prompt=True, tokenize=True, return_dict=False))
    m = build_cfg(Manifest, {"name": "t", "licence": "x", "domains": {
        "d": {"cap_prompts": 9, "sources": [{"path": "x", "provenance": "p"}]}}})
    for limit, kept in ((n, 0), (n + 1, 1)):
        backend = Scripted(tok)
        stats = build(m, [entry], target=str(tiny_target), store_uri=str(tmp_path / f"store{limit}"), backend=backend,
                      cfg=IngestConfig(engine=EngineConfig(max_model_len=limit)))
        assert (stats["regenerated"], stats["prompt_too_long"]["dropped"]) == (kept, 1 - kept), limit
        assert stats["prompt_too_long"]["longest"] == (n if not kept else 0)
