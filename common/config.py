"""Recipes: YAML files turned into frozen, keyword-only dataclasses, with dotted overrides.

A recipe is a mapping of sections (``run``, ``ingest``, ``featurestore``, ``train``, ``serve``,
``evaluate``). Each stage declares its own frozen dataclass; :func:`build` turns a plain mapping into
that dataclass, recursing into nested dataclasses, ``dict[str, Dataclass]`` and
``list[Dataclass]``, and rejects unknown keys by their full dotted name. Overrides
(``train.num_steps=50``) are parsed as YAML scalars and applied to the mapping before it is
validated, so they are checked exactly like the file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, TypeVar, get_args, get_origin

import yaml

from eaglenest.errors import ConfigError

T = TypeVar("T")


def load_yaml(path: str | Path, *, error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """Read a YAML mapping with the safe loader (no object construction)."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{p}: file not found")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise error(f"{p}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise error(f"{p}: the top level must be a mapping")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with ``a.b.c=value`` overrides applied (values parsed as YAML)."""
    import copy

    out = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError(f"override '{item}' has an empty key")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        for k in keys[:-1]:
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{dotted}': '{k}' is not a section")
            node = nxt
        node[keys[-1]] = value
    return out


def build(cls: type[T], data: Any, *, where: str = "", error: type[ConfigError] = ConfigError) -> T:
    """Build dataclass ``cls`` from ``data``, naming the dotted key of any problem."""
    return _convert(cls, data, where, error)


def _name(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _convert(tp: Any, value: Any, where: str, error: type[ConfigError]) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise error(f"{where or 'recipe'}: expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise error(f"{_name(where, str(unknown[0]))}: unknown key")
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = _convert(hints[name], value[name], _name(where, name), error)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise error(f"{_name(where, name)}: required key is missing")
        return tp(**kwargs)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise error(f"{where}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        last: ConfigError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where, error)
            except ConfigError as exc:
                last = exc
        raise last or error(f"{where}: invalid value {value!r}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise error(f"{where}: expected a list, got {type(value).__name__}")
        (item_tp, *_rest) = get_args(tp) or (Any,)
        items = [_convert(item_tp, v, f"{where}[{i}]", error) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise error(f"{where}: expected a mapping, got {type(value).__name__}")
        _k, v_tp = get_args(tp) or (str, Any)
        return {str(k): _convert(v_tp, v, _name(where, str(k)), error) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise error(f"{where}: expected {tp.__name__}, got {value!r}")
        return value
    return value


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config object (for provenance and ``--dry-run``)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj
