"""``python -m eaglenest.serve.draft_check`` on a long-context store (QA9): the check's engines ran at
``max_model_len`` 2048 whatever the prompts, so a features row whose prompt part is longer (the long
recipe's rows reach 8K tokens) was refused by vLLM inside ``generate``, a ValueError traceback after the
target's engine had started. The engines' length now fits the longest prompt and its output within the
target's positions; a prompt past them is refused in one line before any engine starts.
"""

from __future__ import annotations

import json
import shutil

import pytest

from eaglenest.errors import ConfigError
from eaglenest.serve.draft_check import check, engine_len


def test_engine_length_fits_the_longest_prompt_and_its_output(tiny_target):
    assert engine_len(str(tiny_target), [[1] * 10, [1] * 3000, [1] * 5], 64, 2048) == 3064
    assert engine_len(str(tiny_target), [[1] * 10], 64, 2048) == 2048  # short prompts keep the default
    positions = json.loads((tiny_target / "config.json").read_text())["max_position_embeddings"]
    assert positions > 3064  # the fixture leaves room for the cases above
    assert engine_len(str(tiny_target), [[1] * (positions - 1)], 1, 2048) == positions  # exactly the target's


def test_a_target_of_fewer_positions_lowers_the_default(tmp_path, tiny_target):
    short = tmp_path / "short target"
    shutil.copytree(tiny_target, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 1024}))
    assert engine_len(str(short), [[1] * 100], 64, 2048) == 1024
    with pytest.raises(ConfigError, match=r"^--prompts-from: prompt 1 has 1000 tokens, no room for --max-tokens 64 "
                                          r"within the target's 1024 positions: lower --max-tokens$"):
        engine_len(str(short), [[1] * 10, [1] * 1000], 64, 2048)


def test_a_prompt_past_the_positions_is_refused_before_an_engine(tiny_target, toy_export):
    positions = json.loads((tiny_target / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ConfigError, match=rf"^--prompts-from: prompt 0 has {positions} tokens, no room for "
                                          rf"--max-tokens 1 within the target's {positions} positions"):
        check(str(tiny_target), str(toy_export), [[1] * positions], max_tokens=1)
