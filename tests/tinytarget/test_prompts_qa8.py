"""``--prompt-seed`` draws every prompt file anew, the multi-turn dialogues included."""

import json

from eaglenest.tinytarget import prompts


def test_the_prompt_seed_draws_the_dialogues_too_and_the_default_is_unchanged(tmp_path, root):
    """dialogue.jsonl was drawn from a fixed seed whatever ``--prompt-seed`` said: a second prompt set
    (another seed) shared all 40 conversations with the first."""
    a, b, again = tmp_path / "a", tmp_path / "b", tmp_path / "again"
    prompts.write_prompt_files(a)
    prompts.write_prompt_files(b, seed=prompts.PROMPT_SEED + 1)
    prompts.write_prompt_files(again)
    for name in ("arithmetic.jsonl", "dialogue.jsonl"):
        assert (a / name).read_bytes() == (again / name).read_bytes()  # deterministic
        assert (a / name).read_bytes() != (b / name).read_bytes(), name  # another seed, other prompts
    # the default seed writes the committed demo files byte for byte (the reference: recipes/data, not the code)
    committed = root / "recipes" / "data"
    for name in ("arithmetic.jsonl", "dialogue.jsonl"):
        assert (a / name).read_bytes() == (committed / name).read_bytes(), name
    written = [json.loads(line) for line in (a / "dialogue.jsonl").read_text().splitlines()]
    assert len(written) == prompts.NUM_DIALOGUES and written == prompts.dialogue_records(seed=prompts.DIALOGUE_SEED)
