"""Manifest values at the edges: each wrong one is one problem line naming its key."""

import pytest

from eaglenest.ingest.manifest import MAX_GENERATION_TOKENS, read_manifest


def _write(tmp_path, generation: str):
    (tmp_path / "src.jsonl").write_text('{"prompt": "hello there"}\n')
    path = tmp_path / "m.yaml"
    path.write_text(f"name: t\nlicence: CC0-1.0\ngeneration: {{{generation}}}\ndomains:\n  d:\n    cap_prompts: 3\n"
                    f"    sources:\n      - path: '{tmp_path / 'src.jsonl'}'\n        provenance: me\n")
    return path


@pytest.mark.parametrize("value", [2**64, 10**20])
def test_a_max_tokens_past_what_vllm_can_send_to_its_engine_is_refused(tmp_path, value):
    # vLLM's engine core gets SamplingParams as msgpack (64-bit integers): every request failed with
    # OverflowError once the engine had started; the manifest was valid.
    _, problems = read_manifest(_write(tmp_path, f"max_tokens: {value}"))
    assert problems == [f"generation.max_tokens: {value} is more than {MAX_GENERATION_TOKENS} (an engine stops at "
                        "its max_model_len anyway)"]


def test_the_largest_max_tokens_vllm_can_send_is_accepted(tmp_path):
    import msgspec  # vLLM's serializer of SamplingParams to its engine core

    msgspec.msgpack.encode(MAX_GENERATION_TOKENS)  # what the bound is for
    with pytest.raises(OverflowError):
        msgspec.msgpack.encode(2**64)
    _, problems = read_manifest(_write(tmp_path, f"max_tokens: {MAX_GENERATION_TOKENS}"))
    assert problems == []
