"""Recipes: YAML files turned into frozen, keyword-only dataclasses, with dotted overrides.

A recipe is a mapping of sections (``run``, ``ingest``, ``featurestore``, ``train``, ``serve``,
``evaluate``). Each stage declares its own frozen dataclass; :func:`build` turns a plain mapping into
that dataclass, recursing into nested dataclasses, ``dict[str, Dataclass]`` and
``list[Dataclass]``, and rejects unknown keys by their full dotted name. Overrides
(``train.num_steps=50``) are parsed as YAML scalars and applied to the mapping before it is
validated, so they are checked exactly like the file. A recipe stops at its first bad key; a
manifest wants every problem at once (``ingest validate``), so :func:`build` can also collect them
(``problems=``): one walker for both.

Input may be hostile, so parsing is bounded (no YAML aliases; size, value count and nesting capped
by :data:`MAX_YAML_BYTES`, :data:`MAX_YAML_NODES`, :data:`MAX_YAML_DEPTH`) and every message that
echoes a value goes through :func:`short`: a bad key costs one short line whatever its value.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import difflib
import functools
import logging
import math
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, TypeVar, get_args, get_origin

from eaglenest.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")


def printable(text: str) -> str:
    """``text`` with a newline or another control character escaped (``\\n``, ``\\x00``): an error
    line that echoes input stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def short_text(text: str, limit: int = 80) -> str:
    """``text`` cut to at most ``limit`` characters (ending in '...'), for messages that echo input,
    control characters escaped (:func:`printable`)."""
    text = printable(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 3, 80, 80, 80


def short(value: Any, limit: int = 80) -> str:
    """A ``repr`` of ``value`` of at most ``limit`` characters, computed without a full ``repr``
    (a huge value costs no more than a small one)."""
    try:
        return short_text(_repr.repr(value), limit)
    except ValueError:  # an int past Python's int-to-string digit limit
        return f"<{type(value).__name__}>"


# Recipes and manifests are a few KiB and a few hundred values. The pure-Python loader takes about
# a second per 300 KiB of text or per 5,000 values on a loaded 2-core machine, so these bounds keep
# the worst accepted file to a few seconds.
MAX_YAML_BYTES = 256 << 10
MAX_YAML_NODES = 10_000
#: Deeper nesting is refused before the (recursive) composer can exhaust the Python stack.
MAX_YAML_DEPTH = 64


#: A float written without a dot before its exponent (``1e-3``, ``5E+2``): a number to the user.
_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class InvalidYAML(ValueError):
    """Text that is not one YAML document the loader accepts (PyYAML's own error, or refused)."""


class _Refused(InvalidYAML):
    """Input the loader refuses on purpose; the message is one line that starts with the line number."""


@functools.cache
def _yaml():
    """(yaml, the loader class): the safe loader, refusing aliases (``*name``), deep nesting and too
    many values. An alias lets a few hundred bytes stand for billions of nodes ("billion laughs"); no
    recipe or manifest needs one, so refusing them is simpler than bounding their expansion.

    Built on first use: every CLI imports this module through the recipe, and ``--help`` parses no
    YAML, so PyYAML (about a fifth of a ``--help``'s time) is imported only when a file is read."""
    import yaml

    class Loader(yaml.SafeLoader):
        _depth = 0
        _nodes = 0

        def compose_node(self, parent, index):
            event = self.peek_event()
            line = event.start_mark.line + 1
            if isinstance(event, yaml.AliasEvent):
                raise _Refused(f"line {line}: YAML aliases (*{short_text(event.anchor, 40)}) are not allowed; "
                               "write the value out")
            self._nodes += 1
            if self._nodes > MAX_YAML_NODES:
                raise _Refused(f"line {line}: more than {MAX_YAML_NODES} values; recipes and manifests are small")
            self._depth += 1
            try:
                if self._depth > MAX_YAML_DEPTH:
                    raise _Refused(f"line {line}: nested too deeply (more than {MAX_YAML_DEPTH} levels)")
                return super().compose_node(parent, index)
            finally:
                self._depth -= 1

        def construct_mapping(self, node, deep=False):
            self._keys(node)
            return super().construct_mapping(node, deep=deep)

        def _keys(self, node) -> dict[str, int]:
            # PyYAML keeps the last of two equal keys without a word, and reads `yes:`, `1:` or `~:` as
            # True, 1 and None (then equal to `1:`, or turned into the text "None" by a config). A key the
            # mapping sets over one it merges (`<<:`) is YAML's override; a key two merged mappings both
            # bring is refused too: PyYAML 6.0.4 keeps the first or the last of them depending on whether
            # Python interned the key's text (`x` the first, as YAML says; `num_epochs` the last).
            seen: dict[str, int] = {}  # key -> its line
            merged: dict[str, int] = {}
            merges = 0
            for key_node, value_node in node.value:
                line = key_node.start_mark.line + 1
                if key_node.tag == "tag:yaml.org,2002:merge":
                    merges += 1
                    if merges > 1:
                        raise _Refused(f"line {line}: the key '<<' is given twice; merge a list of mappings")
                    subs = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                    for sub in subs:
                        if not isinstance(sub, yaml.MappingNode):  # PyYAML's own error says what it wants
                            continue
                        for key, at in self._keys(sub).items():
                            if key in merged:
                                raise _Refused(f"line {at}: the key {short(key, 40)} is given twice (by two merged "
                                               "mappings)")
                            merged[key] = at
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, str):
                    text = key_node.value if isinstance(key_node, yaml.ScalarNode) else type(key).__name__
                    raise _Refused(f"line {line}: the key {short_text(str(text), 40)} is read as "
                                   f"{type(key).__name__}, not text; quote it")
                if key in seen:
                    raise _Refused(f"line {line}: the key {short(key, 40)} is given twice")
                seen[key] = line
            return {**merged, **seen}

    return yaml, Loader


def parse_yaml(text: str) -> Any:
    """Parse one YAML document with the bounded safe loader; any failure is an :class:`InvalidYAML`."""
    yaml, loader = _yaml()
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader
    except _Refused:
        raise
    except yaml.MarkedYAMLError as exc:
        raise InvalidYAML(_yaml_problem(exc)) from None
    except yaml.YAMLError as exc:
        raise InvalidYAML(str(exc)) from None
    except (ValueError, RecursionError) as exc:  # e.g. an integer past Python's digit limit
        raise InvalidYAML(short_text(str(exc))) from None


def _yaml_problem(exc) -> str:
    """PyYAML's error as one line: where the problem is and what it is. Its text starts with the
    context ("while scanning for the next token") and gives the line and the problem only after it."""
    mark = exc.problem_mark or exc.context_mark
    what = ", ".join(filter(None, (exc.context, exc.problem))) or type(exc).__name__
    if "'\\t'" in what:  # PyYAML's words for a tab where indentation or a token starts
        what += " (a tab: indent with spaces)"
    return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark else what


def load_yaml(path: str | Path, *, error: type[ConfigError] = ConfigError, allow_empty: bool = True) -> dict[str, Any]:
    """Read a YAML mapping with the safe loader (no object construction, no aliases). A file with no
    document (empty, blank or comments only) is ``{}``, or with ``allow_empty=False`` refused. A leading
    ``~`` is expanded as the run keys expand it (``ingest.manifest: ~/m.yaml``: no shell does)."""
    p = Path(path)
    name = short_text(str(p), 200)
    try:
        p = p.expanduser()
    except RuntimeError:  # ~user of no such user: "file not found" below
        pass
    try:
        if p.is_dir():
            raise error(f"{name}: is a directory, not a YAML file")
        if not p.exists():
            raise error(f"{name}: file not found")
        # Read, not stat: a pipe (bash's ``--recipe <(...)``) has no size until it is read.
        with p.open("rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)
        if len(raw) > MAX_YAML_BYTES:
            raise error(f"{name}: larger than {MAX_YAML_BYTES >> 10} KiB; recipes and manifests are small")
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{name}: not UTF-8 text") from None
    except (OSError, ValueError) as exc:  # e.g. a name too long, no permission, a NUL byte
        raise error(f"{name}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        data = parse_yaml(text)
    except _Refused as exc:
        raise error(f"{name}: {exc}") from None
    except InvalidYAML as exc:
        raise error(f"{name}: not valid YAML ({short_text(str(exc).splitlines()[0], 160)})") from None
    if data is None and not allow_empty:
        raise error(f"{name}: empty (no YAML document); write {{}} to use every default")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise error(f"{name}: the top level must be a mapping")
    return data


#: Scalars a command line means as numbers or booleans (YAML 1.2's core schema). PyYAML reads YAML
#: 1.1, where ``0601`` is octal 385, ``12:30`` is 750 (base 60), ``1_000`` is 1000 and yes/no/on/off
#: are booleans: in an override those stay the text typed.
_CORE_SCALAR = re.compile(r"true|True|TRUE|false|False|FALSE|[-+]?(0|[1-9][0-9]*)"
                          r"|[-+]?(\.[0-9]+|[0-9]+\.[0-9]*)([eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
                          r"|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)")
#: YAML 1.1's booleans that an override keeps as text (YAML 1.2 has only true / false).
_YAML11_BOOL = re.compile(r"yes|Yes|YES|no|No|NO|on|On|ON|off|Off|OFF")
#: Where YAML would start a comment: a '#' at the start or after a space.
_COMMENT = re.compile(r"(^|\s)#")


#: A dotted key shown as typed in messages (else quoted, as any odd text is).
_PLAIN_KEY = re.compile(r"[\w.-]+")


def override_value(raw: str) -> Any:
    """The value of ``section.key=raw``: YAML (``[1, 2]``, ``{a: 1}``, ``null``, ``3``, ``1e-4``,
    ``true``), except that YAML 1.1's other numbers, booleans and dates (``0601``, ``12:30``, ``yes``,
    ``2024-01-01``) and plain text holding `` #`` stay the text typed (a comment would silently drop the rest)."""
    text = raw.strip()
    if text == "":
        return ""
    if _COMMENT.search(text) and text[0] not in "[{'\"":
        return raw
    try:
        value = parse_yaml(raw)
    except _Refused as exc:  # a mapping or list the loader refuses (a key that is no text): say why
        if text[0] in "[{":
            raise ConfigError(str(exc)) from None
        return raw
    except InvalidYAML:  # not YAML: the plain string
        return raw
    if isinstance(value, (bool, int, float)) and not _CORE_SCALAR.fullmatch(text):
        return raw
    if isinstance(value, datetime.date):  # YAML 1.1's timestamps (``2024-01-01``): no type takes one
        return raw
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str], texts: dict[str, str] | None = None) -> dict[str, Any]:
    """Return a copy of ``data`` with ``a.b.c=value`` overrides applied (values parsed as YAML); a mapping
    value merges into a mapping already there (:func:`merged`), any other value replaces what is there.
    ``texts``, when given, gets the text typed of each value read as a number, by dotted key: a key
    that takes text takes that (:func:`build`), so ``train.stream.devices=1`` is "1". It also gets each
    YAML 1.1 boolean word typed bare (``no``, ``off``): a key that takes any value refuses it (:func:`build`)."""
    out = copy.deepcopy(data)
    given: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {short(item)} is not of the form section.key=value")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise ConfigError(f"override {short(item)} has an empty key")
        key = ".".join(keys)
        if key in given and given[key] != raw:  # a wrapper's default then the user's: the later one wins
            # (debug, not a warning: wrappers and harnesses do this on purpose; `-vv` and `--dry-run` show it)
            log.debug("override %s given twice (%s, then %s): the later one is used", short(key),
                        short(given[key]), short(raw))
        given[key] = raw
        try:
            value = override_value(raw)
        except ConfigError as exc:
            raise ConfigError(f"{key if _PLAIN_KEY.fullmatch(key) else short(key)}: {exc}") from None
        if texts is not None and (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  or isinstance(value, str) and _YAML11_BOOL.fullmatch(raw.strip())):
            texts[key] = raw.strip()
        elif texts is not None:  # a later value of the key: the earlier one's text no longer applies
            texts.pop(key, None)
        node = out
        for k in keys[:-1]:
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {short(dotted)}: {short(k)} is not a section")
            node = nxt
        old = node.get(keys[-1])
        # A mapping merges into the mapping there, as Hydra and OmegaConf do and as the same keys given
        # dotted would (``train={num_epochs: 3}`` keeps the file's other train keys); null first starts afresh.
        node[keys[-1]] = merged(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return out


def merged(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``new``'s keys set, mappings under the same key merged at any depth."""
    out = dict(base)
    for key, value in new.items():
        old = out.get(key)
        out[key] = merged(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return out


def build(cls: type[T], data: Any, *, where: str = "", error: type[ConfigError] = ConfigError,
          problems: list[str] | None = None, texts: Mapping[str, str] | None = None) -> T | None:
    """Build dataclass ``cls`` from ``data``, naming the dotted key of any problem.

    Raises ``error`` at the first problem; with a ``problems`` list, appends every problem to it
    instead (one line each, key first) and returns None if there was any. ``texts``: the text typed
    of override values read as numbers (:func:`apply_overrides`), taken by the keys that take text."""
    if problems is None:
        return _convert(cls, data, where, error, texts)
    return _collect(cls, data, where, error, problems)


def _name(where: str, key: str) -> str:
    key = short_text(key)
    return f"{where}.{key}" if where else key


def unknown_key(tp: Any, where: str, key: str) -> str:
    """The line for a key dataclass ``tp`` does not have. A key the section moved names its new
    place (the class's ``RENAMED_KEYS``, old name -> dotted new name; e.g. ``TrainConfig``); a misspelt
    one, the section's key it is closest to."""
    new = getattr(tp, "RENAMED_KEYS", {}).get(key)
    if new:
        return f"{_name(where, key)}: renamed to {_name(where, new)}"
    close = difflib.get_close_matches(str(key), [f.name for f in dataclasses.fields(tp) if f.init], n=1, cutoff=0.75)
    return f"{_name(where, key)}: unknown key" + (f"; did you mean {_name(where, close[0])}?" if close else "")


def _collect(tp: Any, value: Any, where: str, error: type[ConfigError], problems: list[str]) -> Any:
    """:func:`_convert` walking on past a problem: each is appended to ``problems``, and a value
    holding one comes back as None. Dataclasses, lists and mappings are walked here; any other value
    (a leaf, a union) goes through :func:`_convert`, so types are checked by one implementation."""
    n0 = len(problems)
    origin = get_origin(tp)
    try:
        if dataclasses.is_dataclass(tp) and isinstance(value, Mapping | None):
            value = {} if value is None else value
            fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
            hints = typing.get_type_hints(tp)
            problems += [unknown_key(tp, where, k) for k in sorted(map(str, set(value) - set(fields)))]
            kwargs = {}
            for name, f in fields.items():
                if name in value:
                    kwargs[name] = _collect(hints[name], value[name], _name(where, name), error, problems)
                elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    problems.append(f"{_name(where, name)}: required key is missing")
            return tp(**kwargs) if len(problems) == n0 else None
        if origin is list and isinstance(value, (list, tuple)):
            (item_tp, *_rest) = get_args(tp) or (Any,)
            items = [_collect(item_tp, v, f"{where}[{i}]", error, problems) for i, v in enumerate(value)]
            return items if len(problems) == n0 else None
        if origin is dict and isinstance(value, Mapping):
            _k, v_tp = get_args(tp) or (str, Any)
            out = {str(k): _collect(v_tp, v, _name(where, str(k)), error, problems) for k, v in value.items()}
            return out if len(problems) == n0 else None
        return _convert(tp, value, where, error)
    except error as exc:  # a leaf's type, or a dataclass's own validation
        problems.append(str(exc))
        return None


def _leaf_name(tp: Any) -> str:
    """How an error names scalar type ``tp`` ('' for a type that is not a scalar)."""
    if tp is type(None):
        return "null"
    if get_origin(tp) is Literal:
        return ", ".join(map(repr, get_args(tp)))
    return tp.__name__ if tp in (int, float, str, bool) else ""


def _one_of(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _convert(tp: Any, value: Any, where: str, error: type[ConfigError], texts: Mapping[str, str] | None = None) -> Any:
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise error(f"{where or 'recipe'}: expected a mapping, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(map(str, set(value) - set(fields)))
        if unknown:
            raise error(unknown_key(tp, where, unknown[0]))
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = _convert(hints[name], value[name], _name(where, name), error, texts)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise error(f"{_name(where, name)}: required key is missing")
        return tp(**kwargs)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise error(f"{where}: {short(value)} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        if bool in args:
            _refuse_yaml11_bool(value, where, error, texts)
        last: ConfigError | None = None
        if any(arg in (int, float) for arg in args):  # a number is one of its values: not the text typed
            texts = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where, error, texts)
            except ConfigError as exc:
                last = exc
        leaves = [_leaf_name(a) for a in args]
        if all(leaves):  # scalars only: name every type the key takes, not just the last one tried
            raise error(f"{where}: expected {_one_of(leaves)}, got {short(value)}")
        raise last or error(f"{where}: invalid value {short(value)}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise error(f"{where}: expected a list, got {type(value).__name__}")
        (item_tp, *_rest) = get_args(tp) or (Any,)
        items = [_convert(item_tp, v, f"{where}[{i}]", error, texts) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise error(f"{where}: expected a mapping, got {type(value).__name__}")
        _k, v_tp = get_args(tp) or (str, Any)
        return {str(k): _convert(v_tp, v, _name(where, str(k)), error, texts) for k, v in value.items()}
    if tp is Any:
        _refuse_yaml11_bool(value, where, error, texts)
        return value
    if tp is float and isinstance(value, str) and _FLOAT_TEXT.fullmatch(value):
        # YAML 1.1 (PyYAML) reads ``1e-3`` as text (it wants ``1.0e-3``); everyone writes a rate that way.
        value = float(value)
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        # YAML reads .inf, .nan and 1.0e+400 as floats; no key gives inf a meaning ("unbounded").
        try:
            value = float(value)
        except OverflowError:  # an int past the float range
            value = math.inf
        if not math.isfinite(value):
            raise error(f"{where}: must be a finite number")
        return value
    if tp is str and (typed := _typed_text(value, where, texts)) is not None:
        return typed
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            # YAML reads `0601`, `12:30`, `yes` or `2024-01-01` as a number, a boolean or a date, and shows it
            # as such (385)
            read = isinstance(value, (bool, int, float, datetime.date))
            hint = "; quote the value for text" if tp is str and read else ""
            raise error(f"{where}: expected {tp.__name__}, got {short(value)}{hint}")
        return value
    return value


def _refuse_yaml11_bool(value: Any, where: str, error: type[ConfigError], texts: Mapping[str, str] | None) -> None:
    """Refuse ``no`` / ``off`` / ``yes`` / ``on`` typed bare on the command line for a key that takes any
    value or a boolean among other types (``ingest.chat_template_kwargs.enable_thinking=no``): a recipe file
    reads it as a boolean, the override keeps the text, and a chat template takes the text 'no' as true."""
    if texts and isinstance(value, str) and texts.get(where) == value.strip() and _YAML11_BOOL.fullmatch(value.strip()):
        raise error(f"{where}: {value.strip()!r} is a boolean in a recipe file but text on the command line; "
                    f"write true or false, or quote it for the text (\"{where}='{value.strip()}'\" in a shell)")


def _typed_text(value: Any, where: str, texts: Mapping[str, str] | None) -> str | None:
    """The text typed on the command line for ``where`` when ``value`` is the number it was read as."""
    if not texts or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    typed = texts.get(where)
    return typed if typed is not None and override_value(typed) == value else None


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config object (for provenance and ``--dry-run``)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj
