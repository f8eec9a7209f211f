import dataclasses

import pytest

from eaglenest.config import apply_overrides, build
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
    assert cfg.items["a"].name == "y" and cfg.ratio == 1.0


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
