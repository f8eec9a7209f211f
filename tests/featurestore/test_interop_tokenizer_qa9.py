"""The hub, ninth pass: ``featurestore import`` holds an eaglenest export's recorded tokenizer files and
chat template against run.target's (another one is refused, or let in with a warning by
run.off_policy=true, as serve export does); a dump that records neither is imported with one warning
naming what could not be checked; an export from a target of another layer count is refused."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

import fs_helpers as H
import interop_helpers as I
from eaglenest.errors import ConfigError, SchemaError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture.identity import tokenizer_hashes, weights_hash
from eaglenest.featurestore.interop import source, specforge, speculators
from eaglenest.featurestore.interop.source import EXPORT_RECORD, SAMPLES
from eaglenest.featurestore.table import store

MODULES = {"speculators": speculators, "specforge": specforge}
UNCHECKED = "tokenizer and chat template are not checked"


def _target(path: Path, template: str = "{{ messages }}", vocab: str = "{}") -> str:
    """interop_helpers' tiny target with tokenizer files and a chat template (all identity hashes)."""
    I.tiny_target(path)
    (path / "tokenizer.json").write_text(vocab)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return str(path)


def _copy(target: str, dst: Path, **edits) -> str:
    """A copy of ``target`` (same weights) with ``tokenizer.json``, the template or config keys edited."""
    shutil.copytree(target, dst)
    if "vocab" in edits:
        (dst / "tokenizer.json").write_text(edits.pop("vocab"))
    if "template" in edits:  # a template file: replaces tokenizer_config.json's, changes no tokenizer file
        (dst / "chat_template.jinja").write_text(edits.pop("template"))
    if edits:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **edits}))
    return str(dst)


@pytest.fixture
def captured(tmp_path):
    """A 3-sample table whose identity records its target's weights, tokenizer and template hashes
    (as a capture's does): ``(uri, target, tmp_path)``."""
    target = _target(tmp_path / "target")
    tok, template = tokenizer_hashes(target)
    comps = {"target": target, "weights_sha256": weights_hash(target), "tokenizer_sha256": tok,
             "chat_template_sha256": template}
    m = dataclasses.replace(H.meta(target=target), identity=json.dumps(comps, sort_keys=True))
    uri = str(tmp_path / "store")
    store.append(uri, "features", pa.Table.from_pylist(I.rows(["d-0", "d-1", "d-2"], m), schema=S.features_schema(m)),
                 meta=m)
    return uri, target, tmp_path


def _export(captured, fmt: str) -> Path:
    uri, target, tmp = captured
    MODULES[fmt].export(source.open_source(uri, "features"), tmp / f"dump {fmt}", target=target)
    return tmp / f"dump {fmt}"


@pytest.mark.parametrize("fmt", list(MODULES))
@pytest.mark.parametrize("edit,what", [({"template": "{{ 'system: hi' }}{{ messages }}"}, "chat template"),
                                       ({"vocab": '{"model": "another"}'}, "tokenizer files")])
def test_interop_an_export_imported_for_another_tokenization_is_refused(captured, fmt, edit, what):
    uri, target, tmp = captured
    dump, other = _export(captured, fmt), _copy(target, tmp / "edited", **edit)
    with pytest.raises(ConfigError, match=f"run.target: the {what} .* differ") as err:
        MODULES[fmt].import_dump(dump, uri, "back", target=other)
    assert "\n" not in str(err.value) and other in str(err.value)
    assert str(err.value).count("sha256") == 1  # only what differs is named
    assert I.versions(uri, "back") is None  # nothing written


@pytest.mark.parametrize("fmt", list(MODULES))
def test_interop_another_tokenization_with_off_policy_imports_with_a_warning(captured, fmt, caplog):
    uri, target, tmp = captured
    dump, other = _export(captured, fmt), _copy(target, tmp / "edited", template="{{ 'x' }}")
    with caplog.at_level(logging.WARNING):
        MODULES[fmt].import_dump(dump, uri, "back", target=other, off_policy=True)
    assert [r for r in caplog.records if "chat template" in r.getMessage() and "importing anyway" in r.getMessage()]
    I.assert_same_rows(uri, "features", "back")


@pytest.mark.parametrize("fmt", list(MODULES))
def test_interop_a_copy_of_the_target_elsewhere_imports_without_a_word(captured, fmt, caplog):
    uri, target, tmp = captured
    dump, same = _export(captured, fmt), _copy(target, tmp / "moved copy")
    with caplog.at_level(logging.WARNING):
        MODULES[fmt].import_dump(dump, uri, "back", target=same)
    assert not [r for r in caplog.records if "tokenizer" in r.getMessage()]
    I.assert_same_rows(uri, "features", "back")


@pytest.mark.parametrize("fmt", list(MODULES))
def test_interop_a_foreign_dump_warns_once_what_it_cannot_check(captured, fmt, caplog):
    uri, target, tmp = captured
    dump = _export(captured, fmt)
    (dump / EXPORT_RECORD).unlink()  # a peer's own dump: no record of the tokenizer it was made with
    (dump / SAMPLES).unlink()
    with caplog.at_level(logging.WARNING):
        MODULES[fmt].import_dump(dump, uri, "back", target=target, layer_ids=[2, 4, 5])
    warned = [r.getMessage() for r in caplog.records if UNCHECKED in r.getMessage()]
    assert len(warned) == 1 and target in warned[0] and "records no tokenizer" in warned[0]
    assert store.read(uri, "back").num_rows == 3


@pytest.mark.parametrize("fmt", list(MODULES))
def test_interop_an_export_from_a_target_of_another_depth_is_refused(captured, fmt):
    uri, target, tmp = captured
    dump = _export(captured, fmt)
    deeper = _copy(target, tmp / "deeper", num_hidden_layers=16)  # same weights file, same width, 16 layers
    with pytest.raises(SchemaError, match="the dump's target has 8 layers .* has 16"):
        MODULES[fmt].import_dump(dump, uri, "back", target=deeper, off_policy=True)
    assert I.versions(uri, "back") is None
