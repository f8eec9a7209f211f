"""The recipe surface a user types, where it gave another value than the one written (QA pass 11).

- YAML merge keys (``<<:``) are accepted, but a key two merged mappings both bring, or a second ``<<`` in one
  mapping, was resolved by PyYAML 6.0.4 differently depending on the key's name (it dedups merged keys by the
  ``id`` of their text: a short interned name such as ``x`` kept the first mapping's value, as YAML says,
  ``num_epochs`` the last). Now refused, as a key given twice in one mapping is.
- ``~`` in the path of a recipe or a manifest (``ingest.manifest: ~/m.yaml``, ``--recipe '~/r.yaml'``): the run
  keys expanded it, the recipe and manifest loader did not, so a manifest path under ``$HOME`` was "file not
  found".
- A date-like value (``2024-01-01``, a branch or a folder name) for a text key said "expected str" without the
  hint a number or a boolean gets: quote it.
"""

from __future__ import annotations

import json
import re

import pytest

from eaglenest.config import load_yaml
from eaglenest.errors import ConfigError
from eaglenest.ingest.cli import main as ingest_main
from eaglenest.recipe import load_recipe


@pytest.mark.parametrize("text,line", [
    ("train:\n  <<: [{num_epochs: 2}, {num_epochs: 5}]\n", 2),
    ("train:\n  <<: [{x: 2}, {x: 5}]\n", 2),
    ("train:\n  <<:\n    - num_epochs: 2\n    - lr: 0.1\n      num_epochs: 5\n", 5),
    ("train:\n  <<: {num_epochs: 2, num_epochs: 4}\n", 2),
    ("train:\n  <<: {<<: [{num_epochs: 2}, {num_epochs: 3}]}\n", 2),
])
def test_a_key_two_merged_mappings_bring_is_refused(tmp_path, text, line):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: line {line}: the key '(num_epochs|x)' is given "
                                          "twice"):
        load_yaml(p)


def test_two_merge_keys_in_one_mapping_are_refused(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  <<: {num_epochs: 2}\n  <<: {num_epochs: 4}\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(p))}: line 3: the key '<<' is given twice"):
        load_yaml(p)


def test_merged_mappings_of_distinct_keys_and_a_key_set_over_them_still_load(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("train:\n  <<: [{num_epochs: 2}, {lr: 0.5, ttt_steps: 3}]\n  ttt_steps: 4\n")
    assert load_yaml(p) == {"train": {"num_epochs": 2, "lr": 0.5, "ttt_steps": 4}}
    recipe = load_recipe(str(p))
    assert (recipe.train.num_epochs, recipe.train.lr, recipe.train.ttt_steps) == (2, 0.5, 4)


def test_a_recipe_and_a_manifest_under_home_are_read_through_a_tilde(tmp_path, monkeypatch, capsys, root):
    home = tmp_path / "home dir"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    (home / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?"}) + "\n"
                                                for i in range(6)))
    (home / "m.yaml").write_text(f"name: tilde\nlicence: CC0-1.0\ndomains:\n  d:\n    cap_prompts: 6\n"
                                 f"    held_out_count: 1\n"
                                 f"    sources:\n      - path: {home / 'prompts.jsonl'}\n"
                                 f"        provenance: written by this test\n")
    (home / "r.yaml").write_text("run:\n  workdir: ~/w\ningest:\n  manifest: ~/m.yaml\ntrain:\n  num_epochs: 3\n")
    recipe = load_recipe("~/r.yaml")
    assert recipe.train.num_epochs == 3 and recipe.run.workdir == str(home / "w")
    assert ingest_main(["validate", "--recipe", "~/r.yaml"]) == 0, capsys.readouterr().err
    assert "~/m.yaml: ok (1 domains" in capsys.readouterr().out
    assert ingest_main(["validate", "--recipe", str(home / "r.yaml"), "--manifest", "~/m.yaml"]) == 0


def test_a_tilde_of_no_such_user_is_file_not_found(tmp_path):
    with pytest.raises(ConfigError, match=r"^~no-such-user-qa11/r\.yaml: file not found$"):
        load_recipe("~no-such-user-qa11/r.yaml")


@pytest.mark.parametrize("override", ["run.target=2024-01-01", "run.workdir=2024-01-01"])
def test_a_date_for_a_text_key_in_a_file_says_to_quote_it(tmp_path, override):
    key, value = override.split("=")
    section, name = key.split(".")
    p = tmp_path / "r.yaml"
    p.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=rf"^{key}: expected str, got .*2024.*; quote the value for text$"):
        load_recipe(str(p))
    # on the command line the value stays the text typed (README: YAML 1.1's dates are text there)
    assert getattr(getattr(load_recipe(str(p), [override]), section), name) == value


@pytest.mark.parametrize("override", ["ingest.chat_template_kwargs.enable_thinking=no",
                                      "evaluate.chat_template_kwargs.enable_thinking=off",
                                      "run.storage_options.allow_http=yes"])
def test_a_yaml_11_boolean_word_for_a_key_of_any_value_is_refused_not_taken_as_text(root, override):
    """``enable_thinking: no`` in a recipe file is false; the same words as an override stayed the text 'no',
    which a chat template reads as true (a non-empty string): thinking turned on by the word that says off."""
    key, word = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: {word!r} .*; write true or false"):
        load_recipe(str(root / "recipes" / "toy.yaml"), [override])


def test_a_boolean_or_a_quoted_word_for_a_key_of_any_value_is_taken_as_written(root):
    toy = str(root / "recipes" / "toy.yaml")
    assert load_recipe(toy, ["ingest.chat_template_kwargs.enable_thinking=false"]).ingest.chat_template_kwargs == {
        "enable_thinking": False}
    assert load_recipe(toy, ["ingest.chat_template_kwargs.lang='no'"]).ingest.chat_template_kwargs == {"lang": "no"}
    assert load_recipe(toy, ["ingest.chat_template_kwargs={enable_thinking: no}"]).ingest.chat_template_kwargs == {
        "enable_thinking": False}  # inside a mapping the value is YAML, as in a file
    assert load_recipe(toy, ["run.storage_options.allow_http=true"]).run.storage_options == {"allow_http": "true"}
    assert load_recipe(toy, ["train.track.run_name=no"]).train.track.run_name == "no"  # a text key takes the text


def test_the_later_of_two_overrides_of_a_key_decides_how_it_is_read(root):
    toy = str(root / "recipes" / "toy.yaml")
    kwargs = load_recipe(toy, ["ingest.chat_template_kwargs.lang=no", "ingest.chat_template_kwargs.lang='no'"])
    assert kwargs.ingest.chat_template_kwargs == {"lang": "no"}
    with pytest.raises(ConfigError, match="'no' is a boolean in a recipe file"):
        load_recipe(toy, ["ingest.chat_template_kwargs.lang='no'", "ingest.chat_template_kwargs.lang=no"])
