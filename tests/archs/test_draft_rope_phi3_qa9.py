"""A Phi-3 / Phi-4-mini config.json as released: LongRoPE under the legacy ``rope_scaling`` and the
pretraining length at the top level (``original_max_position_embeddings: 4096``). transformers (and vLLM,
which reads configs through it) give that top-level length priority; the draft's rotary took the
context length (131072) instead: another attention scaling (1.0 for 1.19) and short factors up to 131072."""

import json

from transformers import AutoConfig

from eaglenest.target import read_config
from eaglenest.train.model import draft_rope

PHI3 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 1141, "hidden_size": 128,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
        "rope_theta": 10000.0, "rope_scaling": {"type": "longrope", "long_factor": [1.5] * 12,
                                                 "short_factor": [1.0] * 12}}


def test_the_draft_rotary_keeps_a_top_level_pretraining_length(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PHI3))
    runs = dict(AutoConfig.from_pretrained(str(tmp_path)).rope_parameters)
    runs.pop("type", None)
    assert runs["original_max_position_embeddings"] == 4096
    assert draft_rope(read_config(tmp_path)) == runs
