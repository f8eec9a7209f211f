"""The store's verbs, fourth pass: sample ids that would break one-line output are refused at write
time; ``query`` and ``verify`` pin the version they read, so a compact and a gc meanwhile do not
delete its files under them."""

import pytest

import fs_helpers as H
from eaglenest.errors import SchemaError
from eaglenest.featurestore import cli
from eaglenest.featurestore.read import query
from eaglenest.featurestore.table import maintenance, store


@pytest.fixture
def three(tmp_path):
    """A store whose features table has versions 1 (empty), 2, 3, 4 (two rows each)."""
    uri, m = str(tmp_path / "store"), H.meta()
    for k in range(3):
        store.append(uri, store.FEATURES, H.table([f"s{k}a", f"s{k}b"], m), meta=m)
    return uri, m


# -- sample ids the store takes ---------------------------------------------------------------------

@pytest.mark.parametrize("bad, shown", [("a\nb", "a\\nb"), ("x\x1b[2Jy", "x\\x1b[2Jy"), ("p\u2028q", "p\\u2028q"),
                                        ("", None)])
def test_sample_id_with_a_control_character_or_empty_is_refused(three, bad, shown):
    """They were stored as given: ``query`` then printed one row over two lines (or cleared the terminal),
    and a later duplicate refusal ("e.g. a<newline>b") was no longer one line."""
    uri, m = three
    with pytest.raises(SchemaError) as info:
        store.append(uri, store.FEATURES, H.table(["fine", bad], m), meta=m)
    msg = str(info.value)
    assert "\n" not in msg and "\x1b" not in msg and "\u2028" not in msg
    assert "write to 'features': row 1: sample_id " in msg, msg
    assert (f"'{shown}' holds a control character" if shown else "sample_id is empty") in msg, msg
    assert store.latest_version(uri, store.FEATURES) == 4 and "fine" not in store.sample_ids(uri, store.FEATURES)



# -- compact and gc while a query reads ------------------------------------------------------------------

@pytest.mark.parametrize("out", [None, "rows.csv"])
def test_query_survives_a_compact_and_gc_meanwhile(three, tmp_path, monkeypatch, capsys, out):
    """``featurestore query`` did not pin what it read: a compact then a gc (--older-than-hours 0) between
    its opening version 4 and reading it deleted version 4's data files under it (a Lance 'Not found')."""
    uri, _ = three
    view = query._view

    def compact_and_gc_first(uri_, ds, **kw):  # another process's maintenance, after the query opened ds
        maintenance.compact(uri_, store.FEATURES)
        maintenance.gc(uri_, store.FEATURES, older_than_hours=0, grace_hours=0)
        return view(uri_, ds, **kw)

    monkeypatch.setattr(query, "_view", compact_and_gc_first)
    argv = ["query", "--sql", "SELECT sample_id FROM features ORDER BY sample_id", f"run.store={uri}"]
    assert cli.main(argv + (["--out", str(tmp_path / out)] if out else [])) == 0, capsys.readouterr().err
    got = (tmp_path / out).read_text().replace('"', "").split() if out else capsys.readouterr().out.split()
    assert got == ["sample_id", "s0a", "s0b", "s1a", "s1b", "s2a", "s2b"]
    assert store.latest_version(uri, store.FEATURES) > 4  # the compact did happen meanwhile


def test_verify_does_not_call_a_table_damaged_when_a_gc_ran_meanwhile(three, monkeypatch):
    """``verify`` reads every byte of a version and did not pin it: a compact and a gc meanwhile deleted its
    data files under the scan, and a healthy table was reported with 'data file ... is missing'."""
    uri, _ = three
    scan, ran = maintenance._scan_fragment, []

    def compact_and_gc_first(frag, meta):  # another process's maintenance, during the scan
        if not ran:
            ran.append(maintenance.compact(uri, store.FEATURES)["version"])
            maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=0)
        return scan(frag, meta)

    monkeypatch.setattr(maintenance, "_scan_fragment", compact_and_gc_first)
    report = maintenance.verify(uri, store.FEATURES)
    assert ran and ran[0] > 4 and report["version"] == 4
    assert report["problems"] == [] and report["ok"] and report["rows"] == 6, report
