"""Hostile recipe input: a YAML syntax error says where and what, a key typed under the wrong
section names the section that has it, and a number a file gives a text key says to quote it."""

import pytest

from eaglenest.config import load_yaml
from eaglenest.errors import ConfigError
from eaglenest.recipe import load_recipe


@pytest.mark.parametrize("text,where,what", [
    ("run:\n\tseed: 3\n", "line 2, column 1", "'\\t'"),  # a tab indent
    ("run: [1, 2\n", "line 2, column 1", "expected ',' or ']'"),  # an unclosed list
    ("run:\n  seed: 3\n bad: 1\n", "line 3, column 2", "expected <block end>"),  # a key indented one space short
    ("run:\n  seed: 3\n---\nrun: {}\n", "line 3, column 1", "another document"),  # two documents
    ('run:\n  workdir: "runs/x\n', "line 3, column 1", "end of stream"),  # an unclosed quote
])
def test_a_yaml_syntax_error_names_its_line_and_the_problem(tmp_path, text, where, what):
    """PyYAML's first line is often only its context ("while scanning for the next token"): the line
    number and the problem were cut off, so a user with a tab in a 200-line recipe was told nothing."""
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_yaml(p)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{p}: not valid YAML")
    assert where in msg and what in msg


def test_a_tab_indent_says_to_indent_with_spaces(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  num_epochs: 2\n\tlr: 1.0e-3\n")
    with pytest.raises(ConfigError, match=r"line 3, column 1: .*tab.*indent with spaces"):
        load_yaml(p)


@pytest.mark.parametrize("override,message", [
    ("train.workdir=runs/x", "train.workdir: unknown key; did you mean run.workdir?"),
    ("serve.ttt_steps=3", "serve.ttt_steps: unknown key; did you mean train.ttt_steps?"),
    ("ingest.layer_ids=[1, 2, 3]", "ingest.layer_ids: unknown key; did you mean featurestore.layer_ids?"),
])
def test_a_key_under_the_wrong_section_names_the_section_that_has_it(root, override, message):
    """``lr=1e-4`` named ``train.lr``, but a key typed under another section than its own (the
    general case of the same slip) said only "unknown key"."""
    with pytest.raises(ConfigError) as err:
        load_recipe(str(root / "recipes" / "toy.yaml"), [override])
    assert str(err.value) == message


def test_a_misspelt_key_still_gets_its_own_sections_close_match(root):
    with pytest.raises(ConfigError, match=r"^train\.num_epoch: unknown key; did you mean train\.num_epochs\?$"):
        load_recipe(str(root / "recipes" / "toy.yaml"), ["train.num_epoch=2"])
    with pytest.raises(ConfigError, match=r"^train\.zzz_nothing: unknown key$"):
        load_recipe(str(root / "recipes" / "toy.yaml"), ["train.zzz_nothing=2"])


@pytest.mark.parametrize("typed,read", [("0601", "385"), ("12:30", "750"), ("yes", "True"), ("1.5", "1.5")])
def test_a_number_a_file_gives_a_text_key_says_to_quote_it(root, tmp_path, typed, read):
    """YAML 1.1 reads ``run_name: 0601`` as 385: the error showed a number the user never typed
    without saying why or what to do."""
    p = tmp_path / "r.yaml"
    recipe = (root / "recipes" / "toy.yaml").read_text()
    p.write_text(recipe.replace("\ntrain:\n", f"\ntrain:\n  track:\n    run_name: {typed}\n", 1))
    with pytest.raises(ConfigError) as err:
        load_recipe(str(p))
    msg = str(err.value)
    assert msg.startswith(f"train.track.run_name: expected str, got {read}")
    assert "quote" in msg and "\n" not in msg
