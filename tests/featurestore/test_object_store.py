"""The feature store on an object store: every verb against a local S3 server (moto, loopback).

One moto server per module (``s3_helpers.moto_s3``). The fast tests write small synthetic tables
with ``store.append`` and run the maintenance and inspection verbs on ``s3://bucket/...``; the
slow one drives the demo's stages (ingest build -> featurestore capture -> train run -> serve
export -> evaluate al) through their console commands with ``run.store=s3://...`` and then greps
everything they wrote, and their logs, for the fake secret.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from eaglenest.errors import ConfigError, StoreError
from eaglenest.featurestore import cli
from eaglenest.featurestore.table import fragments, maintenance, objects, store, versions
from eaglenest.featurestore.read import query
from eaglenest.featurestore.read.reader import SampleReader

import fs_helpers as H  # on sys.path via conftest
import s3_helpers

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def three_versions(s3):
    uri, m = s3.uri("verbs"), H.meta()
    for k in range(3):
        store.append(uri, store.FEATURES, H.table([f"s{k}-{i}" for i in range(4)], m, domain=f"d{k % 2}", seed=k),
                     meta=m, lineage={"manifest_hash": f"m{k}"})
    return uri, m


def test_verbs_versions_query_tags_restore(s3, three_versions):
    uri, m = three_versions
    assert store.exists(uri, store.FEATURES) and store.table_names(uri) == [store.FEATURES]
    vs = versions.list_versions(uri, store.FEATURES)
    assert [v["version"] for v in vs] == [1, 2, 3, 4] and [v["rows"] for v in vs] == [0, 4, 8, 12]
    assert vs[2]["lineage"]["manifest_hash"] == "m1" and vs[2]["lineage"]["parent_version"] == 2
    assert store.head_version(uri, store.FEATURES) == 4  # the head record is an object in the bucket
    assert "verbs/features.lance/" + store.HEAD_FILE in s3.objects("verbs/")
    t = query.run_query(uri, "SELECT domain, count(*) AS n FROM features GROUP BY domain ORDER BY domain")
    assert t.to_pydict() == {"domain": ["d0", "d1"], "n": [8, 4]}
    assert versions.set_tag(uri, store.FEATURES, "good", 3) == 3
    assert versions.diff(uri, store.FEATURES, "good", 4)["added"] == 4
    assert versions.summary(uri, store.FEATURES, "good")["rows"] == 8
    assert cli.main(["tags", f"run.store={uri}"]) == 0
    assert cli.main(["show", f"run.store={uri}"]) == 0
    assert cli.main(["query", "--sql", "SELECT count(*) FROM features", f"run.store={uri}"]) == 0
    new = versions.restore(uri, store.FEATURES, "good")
    assert new == 5 and store.dataset(uri, store.FEATURES).count_rows() == 8
    assert store.read(uri, store.FEATURES, version=4).num_rows == 12  # history kept
    versions.delete_tag(uri, store.FEATURES, "good")


def test_compact_gc_verify(s3):
    uri, m = s3.uri("maint"), H.meta()
    for k in range(3):
        store.append(uri, store.FEATURES, H.table([f"c{k}-{i}" for i in range(3)], m, seed=k), meta=m)
    ids = sorted(store.sample_ids(uri, store.FEATURES))
    # An uncommitted fragment (a writer that died): gc sweeps it after the grace period, here 0.
    orphan = fragments.write_fragment(uri, store.FEATURES, H.table(["orphan"], m), meta=m)
    orphan_key = f"maint/features.lance/data/{orphan[0].files[0].path}"
    assert orphan_key in s3.objects("maint/")
    out = maintenance.compact(uri, store.FEATURES)
    assert out["fragments_before"] == 3 and out["fragments_after"] == 1
    report = maintenance.verify(uri, store.FEATURES)
    assert report["ok"] and report["rows"] == 9 and report["unchecked_files"]  # no CRC sidecars on S3
    gc = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=0)
    assert gc["uncommitted_files_removed"] >= 1 and gc["versions_after"] == [gc["versions_before"][-1]]
    assert orphan_key not in s3.objects("maint/")
    assert sorted(store.sample_ids(uri, store.FEATURES)) == ids  # same rows after compact + gc
    assert cli.main(["verify", f"run.store={uri}"]) == 0
    assert cli.main(["gc", "--older-than-hours", "0", f"run.store={uri}"]) == 0


def test_rollback_detected_and_accepted(s3):
    uri, m = s3.uri("rollback"), H.meta()
    for k in range(2):
        store.append(uri, store.FEATURES, H.table([f"r{k}"], m), meta=m)
    keys = sorted(k for k in s3.objects("rollback/features.lance/_versions/") if k.endswith(".manifest"))
    # v2 manifest names count down: the newest version is the smallest name.
    s3.client().delete_object(Bucket=s3.bucket, Key=keys[0])
    with pytest.raises(StoreError, match="rolled back: version 3 was committed"):
        store.dataset(uri, store.FEATURES)
    assert not maintenance.verify(uri, store.FEATURES)["ok"]
    assert versions.restore(uri, store.FEATURES, 2) == 3
    assert store.read(uri, store.FEATURES).num_rows == 1


def _ids_per_version(uri: str) -> dict[int, list[str]]:
    ds = objects.dataset(objects.join(uri, f"{store.FEATURES}.lance"))
    return {v["version"]: objects.dataset(ds.uri, v["version"]).to_table(columns=["sample_id"])
            .column("sample_id").to_pylist() for v in ds.versions()}


def _race(uri, m, id_sets, monkeypatch):
    """Commit one fragment set per thread, both past the duplicate check before either commits."""
    monkeypatch.setenv("EAGLENEST_FAULT_DELAY", "featurestore.commit_after_check=1.0")
    frags = [fragments.write_fragment(uri, store.FEATURES, H.table(ids, m, seed=k), meta=m)
             for k, ids in enumerate(id_sets)]
    errors, versions_ = [], []

    def commit(f):
        try:
            versions_.append(fragments.commit_fragments(uri, store.FEATURES, f, meta=m))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=commit, args=(f,)) for f in frags]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors, versions_


def test_duplicates_refused_and_racing_writers_store_each_id_once(s3, monkeypatch):
    """No lease on S3: the check and the commit are one step through Lance's commit protocol, so of
    two writers that both passed the check, the loser is re-checked and refused, and no version of
    the table, not even for a moment, holds a sample id twice."""
    uri, m = s3.uri("dups"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a", "b"], m), meta=m)
    with pytest.raises(StoreError, match="would be stored twice"):
        store.append(uri, store.FEATURES, H.table(["b", "c"], m), meta=m)
    errors, committed = _race(uri, m, (["x", "y", "z"], ["y", "z", "w"]), monkeypatch)
    assert len(committed) == 1 and len(errors) == 1, (committed, errors)
    assert isinstance(errors[0], StoreError) and "would be stored twice" in str(errors[0])
    assert "\n" not in str(errors[0])  # one line for the CLI
    ids = store.read(uri, store.FEATURES, columns=["sample_id"]).column("sample_id").to_pylist()
    assert sorted(ids) in (["a", "b", "w", "y", "z"], ["a", "b", "x", "y", "z"])
    for version, vids in _ids_per_version(uri).items():
        assert len(vids) == len(set(vids)), f"version {version} holds a sample id twice: {sorted(vids)}"
    assert maintenance.verify(uri, store.FEATURES)["ok"]


def test_racing_writers_with_disjoint_rows_are_serialized(s3, monkeypatch):
    """Two writers with different samples both pass the check on the same version: the loser's
    commit is refused by Lance, re-checked on the winner's version and made after it."""
    uri, m = s3.uri("serial"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a"], m), meta=m)
    errors, committed = _race(uri, m, (["p", "q"], ["r", "s", "t"]), monkeypatch)
    assert not errors and sorted(committed) == [3, 4]
    ids = store.read(uri, store.FEATURES, columns=["sample_id"]).column("sample_id").to_pylist()
    assert sorted(ids) == ["a", "p", "q", "r", "s", "t"]
    ds = store.dataset(uri, store.FEATURES)
    frag_ids = [f.fragment_id for f in ds.get_fragments()]
    assert len(frag_ids) == len(set(frag_ids))
    assert len(_ids_per_version(uri)[3]) in (3, 4)  # the winner alone, then both
    assert maintenance.verify(uri, store.FEATURES)["ok"]


def test_trainer_reader_reads_s3_bit_exactly(s3, tmp_path):
    m = H.meta()
    t = H.table([f"q{i}" for i in range(6)], m, num_tokens=5)
    local, remote = str(tmp_path / "store"), s3.uri("reader")
    for uri in (local, remote):
        store.append(uri, store.FEATURES, t, meta=m)
    order = [4, 0, 5, 2]
    with SampleReader(store.dataset(local, store.FEATURES)) as a, SampleReader(store.dataset(remote, store.FEATURES)) as b:
        # Both map their fragments' files (non-empty, else the checks below hold vacuously): the local
        # reader found a local file per column, the S3 one none (Lance's blob reader).
        assert a._files.keys() == b._files.keys() and len(b._files) == 1
        assert all(v is not None for f in a._files.values() for v in f.values())
        assert all(v is None for f in b._files.values() for v in f.values())
        xs, ys = list(a.read(order)), list(b.read(order))
        assert [x.index for x in xs] == [y.index for y in ys] == order
        rows = t.to_pylist()
        for x, y in zip(xs, ys, strict=True):
            written = rows[y.index]  # the bytes appended, not only what the local reader says
            assert list(y.input_ids) == list(x.input_ids) == written["input_ids"]
            assert y.aux_stored().view(-1).numpy().tobytes() == x.aux_stored().view(-1).numpy().tobytes() \
                == written["aux_hidden"]
            assert y.last_stored().view(-1).numpy().tobytes() == x.last_stored().view(-1).numpy().tobytes() \
                == written["last_hidden"]


def test_recipe_storage_options_reach_lance_and_pyarrow(s3, monkeypatch):
    """Without the endpoint in the environment, the recipe's options alone find the server, once
    registered where the command resolves its recipe; nothing goes through the environment."""
    from eaglenest import runconfig
    from eaglenest.runconfig import RunConfig

    for k in ("AWS_ENDPOINT_URL", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(k)
    monkeypatch.setattr(runconfig, "_STORAGE_OPTIONS", {})
    uri, m = s3.uri("opts"), H.meta()
    assert objects.lance_options(uri) is None  # nothing registered: Lance would go to real AWS
    env_before = dict(os.environ)
    run = RunConfig(store=uri, storage_options={"aws_endpoint": s3.endpoint, "allow_http": True,
                                                "aws_secret_access_key": "${AWS_SECRET_ACCESS_KEY}"})
    assert objects.lance_options(uri) is None  # building a config registers nothing
    run.register_storage()
    assert dict(os.environ) == env_before
    assert objects.lance_options(uri + "/features.lance")["aws_secret_access_key"] == s3_helpers.FAKE_SECRET
    store.append(uri, store.FEATURES, H.table(["o1", "o2"], m), meta=m)
    assert store.read(uri, store.FEATURES).num_rows == 2 and store.head_version(uri, store.FEATURES) == 2


def test_literal_credentials_are_refused_and_redacted(tmp_path, monkeypatch):
    from eaglenest.provenance import write_provenance
    from eaglenest.runconfig import RunConfig

    with pytest.raises(ConfigError) as info:
        RunConfig(store="s3://b/p", storage_options={"aws_secret_access_key": "literal-secret-1234"})
    assert "literal-secret-1234" not in str(info.value) and "environment" in str(info.value)
    with pytest.raises(ConfigError, match="not a supported store"):
        RunConfig(store="ftp://host/store")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_helpers.FAKE_SECRET)
    path = write_provenance(tmp_path, config={"run": {"storage_options": {"aws_session_token": "tok-literal-99"}},
                                              "note": f"x{s3_helpers.FAKE_SECRET}y"},
                            argv=["train", f"run.storage_options.aws_secret_access_key={s3_helpers.FAKE_SECRET}",
                                  "run.storage_options.aws_session_token=tok-literal-99"])
    text = path.read_text()
    assert s3_helpers.FAKE_SECRET not in text and "tok-literal-99" not in text and "<redacted>" in text


# -- the demo's stages on S3 (slow: vLLM engines, a short training) --------------------------------

def _run(root, env, log, stage, *args):
    proc = subprocess.run([str(BIN / stage), *args], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    log.append(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise AssertionError(f"{stage} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


@pytest.mark.slow
def test_demo_stages_on_s3_and_no_secret_written(s3, tmp_path, root, tiny_target, capsys):
    work, uri = tmp_path / "run", s3.uri("demo/store")
    manifest = tmp_path / "manifest.yaml"
    domains = "".join(textwrap.dedent(f"""
      {d}:
        cap_prompts: 12
        sources:
          - path: {root}/recipes/data/{d}.jsonl
            field: prompt
            system_field: system
            provenance: generated by eaglenest.tinytarget
    """).replace("\n", "\n  ") for d in ("arithmetic", "records"))
    manifest.write_text(f"name: s3test\nlicence: CC0-1.0\nheld_out_fraction: 0.25\nraw_fraction: 0.0\n"
                        f"generation:\n  max_tokens: 48\ndomains:{domains}\n")
    # Credentials only in the environment; the recipe holds the endpoint and a ${VAR} reference.
    env = {**os.environ, **s3.env, "PYTHONUNBUFFERED": "1"}
    for k in ("AWS_ENDPOINT_URL", "AWS_ALLOW_HTTP"):
        env.pop(k)
    common = [f"run.workdir={work}", f"run.target={tiny_target}", f"run.store={uri}",
              f"run.storage_options.aws_endpoint={s3.endpoint}", "run.storage_options.allow_http=true",
              "run.storage_options.aws_secret_access_key=${AWS_SECRET_ACCESS_KEY}",
              "ingest.engine.memory_fraction=0.1", "featurestore.engine.memory_fraction=0.1",
              "evaluate.engine.memory_fraction=0.1"]
    logs: list[str] = []
    _run(root, env, logs, "ingest", "build", "--manifest", str(manifest), *common)
    ingest = json.loads((work / "ingest" / "stats.json").read_text())
    assert ingest["regenerated"] > 0
    _run(root, env, logs, "featurestore", "capture", *common)
    cap = json.loads((work / "featurestore" / "stats.json").read_text())
    assert cap["captured"] > 0 and cap["features_table_version"] >= 2
    keys = s3.objects("demo/store/")
    assert any(k.startswith("demo/store/prompts.lance/_versions/") for k in keys)
    assert any(k.startswith("demo/store/features.lance/data/") for k in keys)
    assert not (work / "store").exists()  # nothing of the store on local disk
    _run(root, env, logs, "train", "run", *common, "train.num_epochs=1", "train.batch_rows=2", "train.warmup_steps=1")
    _run(root, env, logs, "serve", "export", *common)
    # One engine (no lossless re-run, no context buckets): the held-out prompts and the n-gram fit come from S3.
    _run(root, env, logs, "evaluate", "al", *common, "evaluate.max_prompts_per_domain=2", "evaluate.context_buckets=[]",
         "evaluate.check_lossless=false", "evaluate.max_tokens=32")
    report = json.loads((work / "eval" / "report.json").read_text())
    assert report["overall"]["draft_rounds"] > 0 and report["predictability"]["ngram"] is not None
    for verb in (["versions"], ["verify"], ["show"], ["query", "--sql", "SELECT count(*) AS n FROM features"]):
        capsys.readouterr()
        assert cli.main([*verb, *common]) == 0  # in process (the module's environment holds the credentials)
        logs.append(capsys.readouterr().out)
    # (c) the fake secret is nowhere: not in any file the stages wrote, not in their logs, not in the bucket.
    leaked = [str(p) for p in work.rglob("*") if p.is_file() and s3_helpers.FAKE_SECRET.encode() in p.read_bytes()]
    assert leaked == []
    assert not any(s3_helpers.FAKE_SECRET in text for text in logs)
    c = s3.client()
    assert not [k for k in s3.objects("demo/") if s3_helpers.FAKE_SECRET.encode()
                in c.get_object(Bucket=s3.bucket, Key=k)["Body"].read()]
    prov = (work / "featurestore" / "provenance.json").read_text()
    assert "${AWS_SECRET_ACCESS_KEY}" in prov and s3.endpoint in prov  # the reference, never its value
