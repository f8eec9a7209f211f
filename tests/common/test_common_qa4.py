"""QA pass 4 on the shared layer: a config.json transformers refuses, weights that do not match
config.json, and an engine configuration built in code, each one ``ConfigError`` line naming the key
or the target (never a ZeroDivisionError, TypeError or vLLM traceback)."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from eaglenest import cli, launch, memfit
from eaglenest.engine import EngineConfig, make_llm
from eaglenest.engine_errors import weights_mismatch
from eaglenest.errors import ConfigError
from eaglenest.hf import load_config, load_tokenizer
from eaglenest.provenance import write_json_atomic


@pytest.mark.parametrize(("changes", "says"), [
    ({"num_attention_heads": 0}, "ZeroDivisionError"),
    ({"hidden_size": "wide"}, "hidden_size"),
    ({"rope_parameters": "linear"}, "rope_parameters"),
])
def test_a_config_transformers_refuses_is_one_config_error_naming_the_target(changes, says, config_target):
    target = config_target(**changes)
    with pytest.raises(ConfigError) as info:
        load_config(target, trust_remote_code=False)
    message = str(info.value)
    assert message.startswith(f"run.target: {target}: transformers cannot load its config or tokenizer (")
    assert says in message and "\n" not in message


def test_a_target_transformers_loads_is_returned_as_transformers_loads_it(tiny_target):
    """The guard turns failures into one line; what loads is transformers' own result."""
    from transformers import AutoConfig, AutoTokenizer

    assert load_config(tiny_target, trust_remote_code=False).to_dict() == AutoConfig.from_pretrained(
        str(tiny_target)).to_dict()
    assert load_tokenizer(tiny_target, trust_remote_code=False).get_vocab() == AutoTokenizer.from_pretrained(
        str(tiny_target)).get_vocab()


def test_weights_of_another_shape_than_config_json_are_one_line_naming_the_target(config_target):
    """``intermediate_size`` edited past the checkpoint's: vLLM's loader failed with a RuntimeError
    traceback (exit 1); now one ConfigError naming run.target and the tensor, before the engine starts
    (``eaglenest.shapes``; vLLM's own failure is recognised below)."""
    target = config_target(intermediate_size=512)
    with pytest.raises(ConfigError) as info:
        make_llm(str(target), EngineConfig(max_model_len=128, memory_fraction=0.05, in_process=True))
    message = str(info.value)
    assert message.startswith(f"run.target: {target}: weights do not match config.json (")
    assert ("model.layers.0.mlp.down_proj.weight is [128, 384] in model.safetensors, config.json makes it "
            "[128, 512]") in message and "\n" not in message


def load_weights():
    """Stands for a vLLM model's ``load_weights``, whose linear layers check shapes with a bare assert."""
    assert False  # noqa: B011 - the bare assert of vLLM's weight loaders, message and all


def test_only_weight_shape_failures_are_taken_for_a_mismatch():
    """Engine-core start failures are RuntimeErrors too: they keep their traceback and vLLM's log."""
    with pytest.raises(AssertionError) as bare:
        load_weights()
    assert weights_mismatch(bare.value)
    assert weights_mismatch(RuntimeError("Attempted to load weight (torch.Size([8])) into parameter (torch.Size([4]))"))
    assert not weights_mismatch(RuntimeError("Engine core initialization failed. See root cause above."))
    assert not weights_mismatch(AssertionError("a bare assert elsewhere"))


@pytest.mark.parametrize(("changes", "says"), [
    ({"max_model_len": 0}, r"^engine\.max_model_len: must be >= 16, got 0$"),
    ({"max_model_len": -5}, r"^engine\.max_model_len: must be >= 16, got -5$"),
    ({"max_model_len": "4096"}, r"^engine\.max_model_len: must be a whole number, got '4096'$"),
    ({"memory_fraction": 0.0}, r"^engine\.memory_fraction: must be in \(0, 1\], got 0\.0$"),
    ({"memory_fraction": 1.5}, r"^engine\.memory_fraction: must be in \(0, 1\], got 1\.5$"),
    ({"memory_fraction": "half"}, r"^engine\.memory_fraction: must be in \(0, 1\], got half$"),
    ({"seed": 1.5}, r"^engine\.seed: must be a whole number, got 1\.5$"),
    ({"dtype": "fp8"}, r"^engine\.dtype: 'fp8' is not one of 'auto', 'half', 'float16', 'bfloat16', 'float', "
                       r"'float32'$"),
])
def test_an_engine_config_built_in_code_is_checked_before_vllm_is_imported(tiny_target, monkeypatch, changes, says):
    """Sections check their engine under their own name; one built in code (serve's draft check, a
    script) reached vLLM unchecked, as a pydantic traceback or a TypeError from the comparison."""
    import eaglenest.engine

    def no_vllm(*args, **kwargs):
        raise AssertionError("vLLM was reached")

    monkeypatch.setattr(eaglenest.engine, "require", no_vllm)
    with pytest.raises(ConfigError, match=says):
        make_llm(str(tiny_target), EngineConfig(**changes))


def test_two_threads_writing_one_json_file_never_rename_each_others_temporary(tmp_path):
    """Both threads' temporary files had one name (the pid's): one thread renamed the other's, whose own
    rename then failed (FileNotFoundError), and the file could hold the other thread's half-written text."""
    path = tmp_path / "stats.json"
    errors = []

    def writer(n):
        try:
            for i in range(300):
                write_json_atomic(path, {"writer": n, "i": i})
        except OSError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(path.read_text())["i"] == 299
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]


@pytest.mark.parametrize(("changes", "says"), [
    ({"hidden_size": "wide"}, "hidden_size must be a whole number >= 1, got 'wide'"),
    ({"num_hidden_layers": None}, "num_hidden_layers is missing (a size every engine and estimate needs)"),
    ({"intermediate_size": -384}, "intermediate_size must be a whole number >= 1, got -384"),
])
def test_the_memory_estimate_names_a_config_size_it_cannot_read(changes, says, config_target):
    """``evaluate al`` estimates its longest bucket from config.json before transformers reads it:
    ``int(cfg["hidden_size"])`` raised ValueError / KeyError / TypeError tracebacks there."""
    target = config_target(**changes)
    with pytest.raises(ConfigError) as info:
        memfit.check_engine(str(target), tokens=64, engine_dtype="auto", key="evaluate.context_buckets", what="x")
    assert str(info.value) == f"run.target: {target}/config.json: {says}"


def _logs_at_every_level(recipe, args):
    logging.getLogger("eaglenest.qa4").debug("ours at debug")
    logging.getLogger("somelib").debug("a library at debug")
    return 0


def test_each_command_in_one_process_logs_at_its_own_verbosity(monkeypatch, capsys):
    """A notebook or script running several commands: logging was set up by the first one only
    (``basicConfig`` does nothing once a handler is there), so a later ``-vv`` logged no debug line,
    and after a first ``-vv`` every library logged at debug for the rest of the session."""
    root, ours = logging.getLogger(), logging.getLogger("eaglenest")
    monkeypatch.setattr(root, "handlers", [])  # a fresh process: no handler yet
    monkeypatch.setattr(launch, "_our_handler", None, raising=False)  # what an earlier test installed
    levels = root.level, ours.level
    commands = {"x": cli.Command(_logs_at_every_level, "logs", needs_recipe=False)}
    try:
        said = []
        for argv in (["x"], ["x", "-vv"], ["x"]):
            assert cli.run("demo", "d", commands, argv) == 0
            said.append(capsys.readouterr().err)
    finally:
        root.setLevel(levels[0])
        ours.setLevel(levels[1])
    assert "ours at debug" not in said[0] and "a library at debug" not in said[0]
    assert "ours at debug" in said[1] and "a library at debug" in said[1]
    assert "ours at debug" not in said[2] and "a library at debug" not in said[2]
