"""``run.trust_remote_code`` (issue 11): a Kimi-K2-style checkpoint (its own tokenizer class and
config class in ``.py`` files, named by ``auto_map``) is refused with exit 2 and one line naming the
key while the flag is off, loads through its own code when on, and the flag reaches vLLM (engine
arguments, server argv, and a real engine started on the fixture)."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest

from eaglenest.engine import EngineConfig, engine_kwargs
from eaglenest.errors import ConfigError
from eaglenest.hf import check_remote_code, load_config, load_tokenizer, remote_code_needed

TOKENIZER_PY = textwrap.dedent('''
    from transformers import PreTrainedTokenizerFast


    class KimiTestTokenizer(PreTrainedTokenizerFast):
        """The tiny target's tokenizer under a class transformers does not ship."""
''')
CONFIG_PY = textwrap.dedent('''
    from transformers import LlamaConfig


    class KimiTestConfig(LlamaConfig):
        model_type = "kimi_test"
''')


@pytest.fixture(scope="module")
def remote_target(tmp_path_factory, tiny_target):
    """The tiny target with a custom tokenizer class and model type, both behind ``auto_map``."""
    dst = tmp_path_factory.mktemp("remote") / "kimi-test"
    shutil.copytree(tiny_target, dst)
    (dst / "tokenization_kimi_test.py").write_text(TOKENIZER_PY)
    (dst / "configuration_kimi_test.py").write_text(CONFIG_PY)
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="KimiTestTokenizer",
               auto_map={"AutoTokenizer": [None, "tokenization_kimi_test.KimiTestTokenizer"]})
    (dst / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(model_type="kimi_test", auto_map={"AutoConfig": "configuration_kimi_test.KimiTestConfig"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def test_needing_remote_code_is_found_and_refused(remote_target, tiny_target):
    assert remote_code_needed(tiny_target) == []
    found = remote_code_needed(remote_target)
    assert [f.split(" auto_map")[0] for f in found] == ["config.json", "tokenizer_config.json"]
    for load in (check_remote_code, load_tokenizer, load_config):
        with pytest.raises(ConfigError, match=r"^run\.trust_remote_code: .* set run\.trust_remote_code=true "
                                              r"to load it \(off by default because it runs Python code"):
            load(remote_target, trust_remote_code=False)


def test_with_the_flag_the_checkpoints_own_classes_load(remote_target):
    tok = load_tokenizer(remote_target, trust_remote_code=True)
    cfg = load_config(remote_target, trust_remote_code=True)
    assert type(tok).__name__ == "KimiTestTokenizer" and type(cfg).__name__ == "KimiTestConfig"
    assert cfg.model_type == "kimi_test" and cfg.num_hidden_layers == 8
    assert tok.decode(tok("What is 2 + 3?")["input_ids"], skip_special_tokens=True) == "What is 2 + 3?"


@pytest.mark.parametrize("argv", [
    ["eaglenest.ingest.cli", "build"],
    ["eaglenest.evaluate.cli", "al"],
])
@pytest.mark.parametrize("bad", ["missing", "no-config"])
def test_a_target_that_is_not_a_model_is_one_line_and_nothing_written(argv, bad, tmp_path, root, capsys):
    """A path that does not exist, or a folder without config.json: one line naming run.target,
    exit 2, before any folder is made (was: a transformers traceback after the store's lease)."""
    import importlib

    target = tmp_path / "models" / "mine"
    if bad == "no-config":
        target.mkdir(parents=True)
    work = tmp_path / "work"
    main = importlib.import_module(argv[0]).main
    code = main([argv[1], "--recipe", str(root / "recipes/toy.yaml"), f"run.target={target}", f"run.workdir={work}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"{argv[0].split('.')[1]}: error: run.target: {target}"), err
    assert not work.exists()


@pytest.mark.parametrize("argv", [
    ["eaglenest.ingest.cli", "build"],
    ["eaglenest.evaluate.cli", "al"],
    ["eaglenest.evaluate.cli", "offline"],
    ["eaglenest.featurestore.cli", "capture"],
])
def test_entry_points_refuse_with_exit_2_and_one_line(argv, remote_target, tmp_path, root, capsys):
    import importlib

    main = importlib.import_module(argv[0]).main
    code = main([argv[1], "--recipe", str(root / "recipes/toy.yaml"), f"run.target={remote_target}",
                 f"run.workdir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "set run.trust_remote_code=true" in err[0] and "off by default" in err[0]
    assert list(tmp_path.iterdir()) == []  # refused before anything was written (store, eval/, logs/)


def test_the_flag_reaches_vllm_arguments(remote_target):
    from eaglenest.engine import make_llm
    from eaglenest.serve.server import server_argv

    assert engine_kwargs(EngineConfig(), str(remote_target), trust_remote_code=True)["trust_remote_code"] is True
    assert engine_kwargs(EngineConfig(), str(remote_target))["trust_remote_code"] is False
    with pytest.raises(ConfigError, match="run.trust_remote_code=true"):  # before vLLM is even imported
        make_llm(str(remote_target), EngineConfig())
    argv = server_argv(str(remote_target), port=1, draft=None, num_speculative_tokens=3, memory_fraction=0.1,
                       max_model_len=256, trust_remote_code=True)
    assert "--trust-remote-code" in argv
    assert "--trust-remote-code" not in server_argv(str(remote_target), port=1, draft=None, num_speculative_tokens=3,
                                                    memory_fraction=0.1, max_model_len=256)


@pytest.mark.slow
def test_a_real_engine_runs_the_checkpoint_through_its_own_code(remote_target, tiny_target):
    """The custom model type maps to vLLM's Llama (``architectures``); config and tokenizer come
    from the checkpoint's code, and the prompt renders as the tiny target's own template does."""
    from vllm import SamplingParams

    from eaglenest.engine import close_llm, make_llm

    llm = make_llm(str(remote_target), EngineConfig(max_model_len=256, max_num_seqs=2, memory_fraction=0.1),
                   trust_remote_code=True)
    try:
        assert type(llm.llm_engine.model_config.hf_config).__name__ == "KimiTestConfig"
        assert "KimiTestTokenizer" in [c.__name__ for c in type(llm.get_tokenizer()).__mro__]
        out = llm.chat([[{"role": "user", "content": "What is 2 + 3?"}]], SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)[0]
    finally:
        close_llm(llm)
    tok = load_tokenizer(tiny_target, trust_remote_code=False)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    assert list(out.prompt_token_ids) == list(ids) and len(out.outputs[0].token_ids) > 0


def test_a_hub_checkpoints_refusal_becomes_the_same_line():
    """For a hub id nothing is checked up front: transformers' own refusal is turned into the line."""
    from transformers.dynamic_module_utils import resolve_trust_remote_code

    from eaglenest.hf import _load

    def loader(name, trust_remote_code):  # transformers' real decision for a repo with only remote code
        return resolve_trust_remote_code(trust_remote_code, name, has_local_code=False, has_remote_code=True)

    with pytest.raises(ConfigError, match=r"^run\.trust_remote_code: org/remote-model ships its own code"):
        _load(loader, "org/remote-model", False)


def test_vllms_own_refusal_becomes_the_same_line(remote_target, monkeypatch):
    """Without the up-front check (as for a hub id), vLLM itself refuses while reading the config, in
    process and before any engine starts; make_llm turns that into the one line."""
    import eaglenest.hf
    from eaglenest.engine import make_llm

    monkeypatch.setattr(eaglenest.hf, "remote_code_needed", lambda target: [])
    with pytest.raises(ConfigError, match=r"^run\.trust_remote_code: .* ships its own code; set run\.trust_"):
        make_llm(str(remote_target), EngineConfig(max_model_len=256, memory_fraction=0.1))
