"""The store as a hub, fourth pass: a failed import on object storage leaves no empty table (and never
removes one another writer committed to), a SpecForge dump with a file name that is not UTF-8 or a file
cut to 0 bytes, sample ids with control characters in an eaglenest export's index, and index lines whose
strings hold a raw U+2028 (JSON Lines end at '\n' only)."""

import json
import os

import pyarrow as pa
import pytest

import interop_helpers as I
from interop_helpers import base  # noqa: F401  (a fixture: the table both files start from)
from eaglenest.errors import SchemaError, StoreError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.interop import sink, source, specforge, speculators
from eaglenest.featurestore.table import store


# -- a failed import into a new table on object storage ------------------------------------------------

def test_failed_import_on_object_storage_leaves_no_table(base, s3):
    """It left the empty table (its first manifest) and the four rows' data files in the bucket:
    ``_remove_uncommitted`` skipped object stores."""
    _, target, _ = base
    dump, remote = I.nan_dump(base), s3.uri("failed-import")
    with pytest.raises(SchemaError, match=r"data_4\.ckpt: aux hidden states hold NaN"):
        specforge.import_dump(dump, remote, "back", target=target, budget_bytes=1)
    assert not store.exists(remote, "back") and store.table_names(remote) == []
    assert s3.objects("failed-import/back.lance") == {}


def test_failed_import_on_object_storage_keeps_what_another_writer_committed(base, s3, monkeypatch):
    """The cleanup re-checks the table: rows another writer committed after this import created it stay."""
    _, target, _ = base
    dump, remote = I.nan_dump(base), s3.uri("raced-import")
    remove = sink._remove_uncommitted

    def other_writer_first(uri_, name, **kw):
        meta = sink.record_meta(json.loads((dump / "eaglenest_export.json").read_text()), "record")
        rows = pa.Table.from_pylist(I.rows(["other-0"], meta), schema=S.features_schema(meta))
        store.append(uri_, name, rows, meta=meta)
        remove(uri_, name, **kw)

    monkeypatch.setattr(sink, "_remove_uncommitted", other_writer_first)
    with pytest.raises(SchemaError, match="NaN"):
        specforge.import_dump(dump, remote, "back", target=target, budget_bytes=1)
    assert store.sample_ids(remote, "back") == {"other-0"}


# -- a SpecForge dump whose file names are not UTF-8 ---------------------------------------------------

def test_specforge_file_name_not_utf8_is_named(base):
    """A file renamed with a Latin-1 byte was 'unreadable feature file (UnicodeEncodeError: ... surrogates
    not allowed)', the path in the message holding a lone surrogate (which stderr cannot print)."""
    uri, target, tmp = base
    specforge.export(source.open_source(uri, "features"), tmp / "sf", target=target)
    path = next((tmp / "sf").rglob("data_2.ckpt"))
    os.rename(os.fsencode(path), os.fsencode(path.parent) + b"/data_2\xe9.ckpt")
    for drop in ((), ("eaglenest_export.json", "eaglenest_samples.jsonl")):  # an eaglenest export, a foreign dump
        for f in drop:
            (tmp / "sf" / f).unlink()
        with pytest.raises(StoreError) as info:
            specforge.import_dump(tmp / "sf", uri, "back", target=target, layer_ids=[2, 4, 6])
        msg = str(info.value)
        assert "data_2\\xe9.ckpt: the file's path is not UTF-8 (byte 0xe9)" in msg, msg
        msg.encode("utf-8")  # printable as it is: no lone surrogate
        assert not store.exists(uri, "back")


# -- control characters in an eaglenest export's sample ids ---------------------------------------------

@pytest.mark.parametrize("module", [specforge, speculators])
@pytest.mark.parametrize("key, value", [("sample_id", "d-02\nforged"), ("sample_id", "d-02\x1b[2J"),
                                        ("sample_id", "d-02\u2028x"), ("split", "train\r")])
def test_control_character_in_an_exported_id_is_refused(base, module, key, value):
    """They were imported as they were, and later broke one-line errors and ``query`` output."""
    uri, target, tmp = base
    module.export(source.open_source(uri, "features"), tmp / "out", target=target)
    index = tmp / "out" / "eaglenest_samples.jsonl"
    lines = index.read_text().splitlines()
    lines[2] = json.dumps({**json.loads(lines[2]), key: value})
    index.write_text("\n".join(lines) + "\n")
    with pytest.raises(SchemaError) as info:
        module.import_dump(tmp / "out", uri, "back", target=target)
    msg = str(info.value)
    bad = next(c for c in value if not c.isprintable())
    assert f"eaglenest_samples.jsonl:3: key '{key}'" in msg and repr(bad) in msg, msg
    assert "\n" not in msg and "\r" not in msg and "\x1b" not in msg and "\u2028" not in msg
    assert not store.exists(uri, "back")


# -- a dump with one file cut to nothing ----------------------------------------------------------------

def test_specforge_empty_feature_file_says_so(base):
    """A file an interrupted copy left at 0 bytes read 'unreadable feature file (EOFError: )'."""
    uri, target, tmp = base
    specforge.export(source.open_source(uri, "features"), tmp / "sf", target=target)
    path = next((tmp / "sf").rglob("data_3.ckpt"))
    path.write_bytes(b"")
    with pytest.raises(StoreError) as info:
        specforge.import_dump(tmp / "sf", uri, "back", target=target)
    assert f"{path}: unreadable feature file (the file is empty, 0 bytes: a partial copy?)" in str(info.value)
    assert not store.exists(uri, "back")


@pytest.mark.parametrize("module", [specforge, speculators])
def test_index_line_with_a_raw_line_separator_in_a_string_imports(base, module):
    """JSON Lines end at '\\n' only; the index was read with str.splitlines(), which also splits at a raw
    U+2028 or U+0085 inside a JSON string (json.dumps(ensure_ascii=False) writes them so): a valid line was
    refused as 'not valid JSON', numbered wrong. ``source`` is free text, so it may hold one."""
    uri, target, tmp = base
    module.export(source.open_source(uri, "features"), tmp / "out", target=target)
    index = tmp / "out" / "eaglenest_samples.jsonl"
    lines = [json.loads(x) for x in index.read_text().splitlines()]
    lines[1]["source"] = "part one\u2028part two\x85end"
    index.write_text("".join(json.dumps(d, ensure_ascii=False) + "\r\n" for d in lines), encoding="utf-8")
    assert module.import_dump(tmp / "out", uri, "back", target=target)["rows"] == 5
    got = {r["sample_id"]: r["source"] for r in store.read(uri, "back").to_pylist()}
    assert got[lines[1]["sample_id"]] == "part one\u2028part two\x85end"
    assert sorted(got) == sorted(d["sample_id"] for d in lines)
