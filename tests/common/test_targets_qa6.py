"""QA of targets and engines, sixth pass: each caller names its own key for the target (``run.target``,
a command's ``--model``) and its own engine section, without re-labelling another's message; a
``max_model_len`` past the target's positions (rotary scaling counted as vLLM counts it) and a
config.json transformers refuses are one line before vLLM starts, not its traceback after."""

from __future__ import annotations

import json
import shutil

import pytest

from eaglenest import engine
from eaglenest.engine import EngineConfig, make_llm
from eaglenest.errors import ConfigError
from eaglenest.hf import check_target
from eaglenest.precheck import check_max_model_len
from eaglenest.target import max_positions


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if an engine would start: every refusal here comes before vLLM does."""
    monkeypatch.setattr(engine, "_start", lambda *a, **k: pytest.fail("a vLLM engine was started"))


def _target(tmp_path, tiny_target, **changes):
    target = tmp_path / "target"
    shutil.copytree(tiny_target, target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, **changes}))
    return target


def test_check_target_names_the_callers_key(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError) as err:
        check_target(missing, key="--model")
    assert str(err.value).startswith(f"--model: {missing}: no such directory"), err.value
    assert "run.target" not in str(err.value)


def test_make_llm_names_the_callers_key_for_a_config_transformers_refuses(tmp_path, tiny_target, no_engine):
    """A string where config.json takes a whole number: transformers' strict config refuses it, which
    vLLM did inside its engine start (a StrictDataclassFieldValidationError traceback)."""
    target = _target(tmp_path, tiny_target, max_position_embeddings="32768")
    with pytest.raises(ConfigError) as err:
        make_llm(str(target), EngineConfig(max_model_len=128), key="--model")
    text = str(err.value)
    assert text.startswith(f"--model: {target}: transformers cannot load its config") and "\n" not in text, text
    assert "max_position_embeddings" in text and "'32768'" in text, text


def test_a_max_model_len_past_the_positions_names_the_section_before_vllm(tiny_target, no_engine, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    limit = json.loads((tiny_target / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ConfigError) as err:
        make_llm(str(tiny_target), EngineConfig(max_model_len=limit + 1), where="ingest.engine")
    assert str(err.value) == (f"ingest.engine.max_model_len: {limit + 1} is more than {tiny_target} has positions "
                              f"for (max_position_embeddings={limit}); set ingest.engine.max_model_len={limit} or less")


def test_vllms_own_override_of_the_limit_is_left_to_it(tiny_target, monkeypatch):
    limit = json.loads((tiny_target / "config.json").read_text())["max_position_embeddings"]
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    check_max_model_len(str(tiny_target), limit * 2)  # vLLM warns and runs it: not refused here


ROPES = {
    "default": {"rope_theta": 10000.0, "rope_type": "default"},
    "linear x2": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 2.0},
    "dynamic x3 (old key)": {"type": "dynamic", "factor": 3.0},
    "yarn x4": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3 x8": {"rope_theta": 10000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("name", list(ROPES))
def test_the_limit_is_the_one_vllm_derives(tmp_path, tiny_target, name):
    """Equivalence with vLLM's own ModelConfig check (no engine): the limit is accepted, one more
    refused. A rope-scaled target keeps what vLLM allows it (linear, dynamic), and YaRN or Llama-3
    scaling, whose max_position_embeddings is already the scaled length, is not multiplied again."""
    from vllm.engine.arg_utils import EngineArgs

    key = "rope_scaling" if "old key" in name else "rope_parameters"
    target = _target(tmp_path, tiny_target, max_position_embeddings=64, **{key: ROPES[name]})
    limit, _ = max_positions(json.loads((target / "config.json").read_text()))
    assert EngineArgs(model=str(target), max_model_len=limit).create_model_config().max_model_len == limit
    with pytest.raises(ValueError, match=rf"User-specified max_model_len \({limit + 1}\) is greater"):
        EngineArgs(model=str(target), max_model_len=limit + 1).create_model_config()
    check_max_model_len(str(target), limit)
    with pytest.raises(ConfigError, match=rf"^engine\.max_model_len: {limit + 1} is more than "):
        check_max_model_len(str(target), limit + 1)


@pytest.mark.parametrize("cfg", [
    {"max_position_embeddings": 64, "model_max_length": 4096},  # vLLM lets model_max_length raise it
    {"max_position_embeddings": "64"},
    {"max_position_embeddings": 64, "rope_parameters": {"rope_type": "linear", "factor": "2"}},
])
def test_a_config_that_does_not_tell_the_limit_is_left_to_vllm(cfg):
    assert max_positions(cfg) is None


@pytest.mark.parametrize("extra", [1, 20000])
def test_a_config_naming_more_layers_than_the_weights_hold_is_refused(tmp_path, tiny_target, extra):
    """Only tensors of both were compared: one layer more passed (vLLM then failed on the weights it
    lacks, a traceback), and a typo's thousands took minutes to build on the meta device first."""
    from eaglenest.shapes import check_weight_shapes

    held = json.loads((tiny_target / "config.json").read_text())["num_hidden_layers"]
    target = _target(tmp_path, tiny_target, num_hidden_layers=held + extra)
    with pytest.raises(ConfigError) as err:
        check_weight_shapes(target, key="--model")
    assert str(err.value).startswith(f"--model: {target}/config.json: num_hidden_layers is {held + extra}, the "
                                     f"weights hold {held} layers (0..{held - 1}); "), err.value


def test_more_sequences_a_step_than_vllm_schedules_tokens_is_one_line(tiny_target):
    """vLLM refuses ``max_num_seqs`` past its ``max_num_batched_tokens`` in its scheduler config (a
    pydantic ValidationError traceback from inside ``LLM()``); found before any weight is loaded."""
    with pytest.raises(ConfigError) as err:
        make_llm(str(tiny_target), EngineConfig(max_model_len=128, max_num_seqs=1_000_000, memory_fraction=0.05),
                 where="ingest.engine")
    text = str(err.value)
    assert text.startswith("ingest.engine.max_num_seqs: 1000000 is more than the ") and "\n" not in text, text
    assert "tokens vLLM schedules a step (its max_num_batched_tokens); set ingest.engine.max_num_seqs=" in text


@pytest.mark.parametrize("name", ["tokenize", "add_generation_prompt"])
def test_apply_chat_templates_own_arguments_are_no_template_variables(name):
    """``ingest.chat_template_kwargs={tokenize: true}`` was accepted; every render of eaglenest's own
    (ingest's long-prompt check, evaluate's prompts) then raised "apply_chat_template() got multiple values
    for keyword argument 'tokenize'", a traceback once the engine had started."""
    from eaglenest.recipe import load_recipe

    with pytest.raises(ConfigError, match=rf"^ingest\.chat_template_kwargs: {name} is an argument of transformers' "
                                          "apply_chat_template, not a chat template variable"):
        load_recipe("recipes/toy.yaml", [f"ingest.chat_template_kwargs={{{name}: true}}"])
    assert load_recipe("recipes/toy.yaml", ["ingest.chat_template_kwargs={enable_thinking: true}"])


def test_the_refused_names_are_transformers_own():
    """Every named argument of the installed transformers' apply_chat_template is refused (a new one is
    caught here), and nothing else."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    from eaglenest.ingest.config import TEMPLATE_CALL_ARGS

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    assert set(TEMPLATE_CALL_ARGS) == set(params) - {"self", "kwargs"}


@pytest.mark.parametrize("archs", [[None], ["LlamaForCausalLM", 7], [""]])
def test_architectures_that_are_no_class_names_are_refused(tmp_path, tiny_target, archs):
    """Entries that are not text were skipped, and with no other name the list passed: vLLM then failed
    looking them up, inside its engine start."""
    target = _target(tmp_path, tiny_target, architectures=archs)
    with pytest.raises(ConfigError) as err:
        check_target(target)
    assert str(err.value).startswith(f"run.target: {target}/config.json: architectures must be model class names, "
                                     f"got {json.dumps(archs)}"), err.value


def test_ingest_build_refuses_an_engine_length_past_the_targets_positions_before_writing(tmp_path, tiny_target,
                                                                                       capsys):
    """``ingest.engine.max_model_len`` past the target's positions was refused by vLLM once the engine
    started (the store made, the pool read): one line naming the key and the limit, nothing written."""
    from eaglenest.ingest.cli import main

    limit = max_positions(json.loads((tiny_target / "config.json").read_text()))[0]
    src = tmp_path / "src.jsonl"
    src.write_text('{"prompt": "a"}\n')
    manifest = tmp_path / "m.yaml"
    manifest.write_text(f"name: t\nlicence: x\ndomains:\n  d:\n    cap_prompts: 5\n    sources:\n"
                        f"      - path: {src}\n        provenance: p\n")
    work = tmp_path / "work"
    assert main(["build", "--manifest", str(manifest), f"run.workdir={work}", f"run.target={tiny_target}",
                 f"ingest.engine.max_model_len={limit + 1}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"ingest: error: ingest.engine.max_model_len: {limit + 1} is more than {tiny_target} has "
                     f"positions for (max_position_embeddings={limit}); set ingest.engine.max_model_len={limit} "
                     "or less"], lines
    assert not (work / "store").exists()
