import dataclasses

import pytest

from eaglenest.config import apply_overrides, build, load_yaml
from eaglenest.errors import ConfigError
from eaglenest.recipe import load_recipe


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    n: int = 1
    name: str = "x"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
    inner: Inner = Inner()
    ratio: float = 0.5
    items: dict[str, Inner] = dataclasses.field(default_factory=dict)
    required: str


def test_build_nested_and_defaults():
    cfg = build(Outer, {"required": "r", "inner": {"n": 3}, "items": {"a": {"name": "y"}}, "ratio": 1})
    assert cfg.inner.n == 3 and cfg.inner.name == "x"
    assert cfg.items["a"].name == "y" and cfg.ratio == 1.0 and type(cfg.ratio) is float  # 1 == 1.0 alone


@pytest.mark.parametrize("data,message", [
    ({"required": "r", "inner": {"m": 1}}, "inner.m: unknown key"),
    ({"required": "r", "items": {"a": {"bogus": 1}}}, "items.a.bogus: unknown key"),
    ({}, "required: required key is missing"),
    ({"required": "r", "inner": {"n": "three"}}, "inner.n: expected int"),
    ({"required": "r", "inner": {"n": True}}, "inner.n: expected int"),
])
def test_build_errors_name_the_key(data, message):
    with pytest.raises(ConfigError) as exc:
        build(Outer, data)
    assert message in str(exc.value)


def test_overrides_parse_yaml_scalars():
    out = apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=true", "d.e=hello", "a.f=[1, 2]"])
    assert out == {"a": {"b": 2, "c": True, "f": [1, 2]}, "d": {"e": "hello"}}


def test_override_into_scalar_is_an_error():
    with pytest.raises(ConfigError, match="'b' is not a section"):
        apply_overrides({"a": {"b": 1}}, ["a.b.c=2"])


def test_recipe_overrides_are_validated(root, monkeypatch):
    monkeypatch.chdir(root)
    r = load_recipe("recipes/toy.yaml", ["train.ttt_steps=3", "run.workdir=/tmp/x"])
    assert r.train.ttt_steps == 3 and r.run.workdir == "/tmp/x"
    assert r.run.store_uri == "/tmp/x/store"
    with pytest.raises(ConfigError, match="train.no_such_key: unknown key"):
        load_recipe("recipes/toy.yaml", ["train.no_such_key=1"])
    with pytest.raises(ConfigError, match="bogus: unknown recipe section"):
        load_recipe("recipes/toy.yaml", ["bogus.x=1"])


@pytest.mark.parametrize("raw,value", [
    ("0601", "0601"), ("007", "007"), ("12:30", "12:30"), ("1_000", "1_000"), ("0x1F", "0x1F"),  # YAML 1.1 numbers
    ("yes", "yes"), ("off", "off"),  # YAML 1.1 booleans
    ("/tmp/x #y", "/tmp/x #y"), ("#1", "#1"),  # a comment would drop the rest silently
    ("3", 3), ("-2", -2), ("0", 0), ("1.5", 1.5), (".5", 0.5), ("1.0e-4", 1e-4), ("true", True), ("False", False),
    ("null", None), ("~", None), ("", ""), ("  ", ""), ("[1, 2]", [1, 2]), ("{a: 1}", {"a": 1}),
    ('"run #3"', "run #3"), ("a#b", "a#b"),
])
def test_override_values_are_yaml_core_scalars_or_the_text_typed(raw, value):
    """``train.track.run_name=0601`` is the name typed, not 385 (YAML 1.1 octal); a number that looks
    like one (``3``, ``1.5``) is still a number."""
    out = apply_overrides({}, [f"a.b={raw}"])["a"]["b"]
    assert out == value and type(out) is type(value)


def test_run_name_override_keeps_leading_zeros(root, monkeypatch):
    monkeypatch.chdir(root)
    assert load_recipe("recipes/toy.yaml", ["train.track.run_name=0601"]).train.track.run_name == "0601"


@pytest.mark.parametrize("text,message", [
    ("run:\n  workdir: /tmp/a\nrun:\n  target: x\n", "line 3: the key 'run' is given twice"),
    ("train:\n  num_epochs: 3\n  num_epochs: 4\n", "line 3: the key 'num_epochs' is given twice"),
    ("domains:\n  yes: {}\n", "line 2: the key yes is read as bool, not text; quote it"),
    ("domains:\n  1: {}\n  '1': {}\n", "line 2: the key 1 is read as int, not text"),
    ("domains:\n  ~: {}\n", "line 2: the key ~ is read as NoneType"),
])
def test_repeated_and_non_text_keys_are_refused(tmp_path, text, message):
    """PyYAML keeps the last of two equal keys without a word (a second ``run:`` would drop the
    first's workdir), and turns ``yes:`` / ``1:`` / ``~:`` into True / 1 / None."""
    p = tmp_path / "r.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_yaml(p)
    assert message in str(err.value) and str(p) in str(err.value)


def test_merge_keys_may_repeat_a_key_they_bring(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("c:\n  <<: {a: 1, b: 2}\n  a: 3\n")
    assert load_yaml(p) == {"c": {"a": 3, "b": 2}}


def test_control_characters_in_an_echoed_key_stay_on_one_line():
    with pytest.raises(ConfigError) as err:
        build(Outer, {"required": "r", "inner": {"na\nme": 1}})
    assert "\n" not in str(err.value) and "inner.na\\nme: unknown key" in str(err.value)


def test_default_recipe_outside_a_checkout_says_how_to_give_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="default recipe.*give --recipe"):
        load_recipe()
    with pytest.raises(ConfigError, match="--recipe: empty path"):
        load_recipe("")


def test_a_union_key_names_every_type_it_takes(root, monkeypatch):
    monkeypatch.chdir(root)
    with pytest.raises(ConfigError, match=r"train\.table_version: expected int, str or null, got 1\.5"):
        load_recipe("recipes/toy.yaml", ["train.table_version=1.5"])
    with pytest.raises(ConfigError, match=r"train\.sliding_window: expected int or 'auto', got 1\.5"):
        load_recipe("recipes/toy.yaml", ["train.sliding_window=1.5"])


def test_a_store_that_is_a_file_is_refused_naming_the_key(root, tmp_path):
    """Every stage said only "no prompts table in <file>" (capture) or failed inside Lance."""
    f = tmp_path / "store.lance"
    f.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^run\.store: .*store\.lance is a file; the store is a folder"):
        load_recipe(str(root / "recipes" / "toy.yaml"), [f"run.workdir={tmp_path}", f"run.store={f}"])
    assert load_recipe(str(root / "recipes" / "toy.yaml"), [f"run.workdir={tmp_path}",
                                                            f"run.store={tmp_path / 'new'}"]).run.store_uri


def test_a_target_config_that_is_not_an_object_is_one_line(tmp_path):
    # config.json holding a list: an AttributeError traceback in serve export and train run.
    from eaglenest.target import read_config

    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"^run.target: .*config.json is not a JSON object"):
        read_config(tmp_path)
