"""What the ``provenance.json`` of ``ingest build`` and ``featurestore capture`` says they wrote, and from which
target (QA pass 8). Both named the target by its path alone and neither named the table version it committed
(that was only in stats.json): a user reading the file could not say which prompts / features version came
from which run, nor from which weights. Now, like ``train run`` and ``serve export``: ``inputs`` name the
target's weights, tokenizer and chat template hashes, ``outputs`` the store, table and version written.

The ingest run regenerates through a scripted backend first (tests/ingest/ingest_helpers.py: no engine), then
the command itself re-runs over the same manifest (nothing left to do: no engine); the capture is real vLLM
on two short rows (one engine start), in a workdir whose path holds a space."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaglenest.featurestore import schema
from eaglenest.featurestore.capture import identity, policy
from eaglenest.featurestore.cli import main as featurestore_main
from eaglenest.featurestore.table import store
from eaglenest.hf import load_tokenizer
from eaglenest.ingest import contamination
from eaglenest.ingest.build import build
from eaglenest.ingest.cli import main as ingest_main
from eaglenest.ingest.config import IngestConfig
from eaglenest.ingest.manifest import load_manifest
from eaglenest.ingest.pool import load_pool

TESTS = Path(__file__).resolve().parent.parent
for _folder in ("ingest", "featurestore"):  # their helper modules, as their own conftests put them
    if str(TESTS / _folder) not in sys.path:
        sys.path.insert(0, str(TESTS / _folder))

import fs_helpers  # noqa: E402
from ingest_helpers import Scripted  # noqa: E402


def _target_hashes(target: Path) -> dict:
    tok, template = identity.tokenizer_hashes(str(target))
    return {"target": str(target), "weights_sha256": identity.weights_hash(str(target)),
            "tokenizer_sha256": tok, "chat_template_sha256": template}


def _manifest(folder: Path) -> Path:
    data = folder / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i + 3}?"}) + "\n" for i in range(4)))
    path = folder / "manifest.yaml"
    path.write_text(f"name: prov\nlicence: CC0-1.0\ngeneration:\n  max_tokens: 4\ndomains:\n  d:\n"
                    f"    cap_prompts: 4\n    held_out_count: 1\n    sources:\n      - path: {data}\n"
                    f"        provenance: written by this test\n")
    return path


def test_ingest_build_provenance_names_the_prompts_version_it_wrote_and_the_targets_hashes(tmp_path, tiny_target):
    folder = tmp_path / "a run"
    folder.mkdir()
    manifest_path, uri = _manifest(folder), str(folder / "store")
    manifest = load_manifest(manifest_path)
    pool, _ = contamination.check(load_pool(manifest, target=str(tiny_target)), manifest)
    tok = load_tokenizer(str(tiny_target), trust_remote_code=False)
    stats = build(manifest, pool, target=str(tiny_target), store_uri=uri, cfg=IngestConfig(), backend=Scripted(tok))
    assert stats["regenerated"] == 3 and stats["heldout_written"] == 1
    version = store.latest_version(uri, store.PROMPTS)
    # the command over the same pool: nothing left to regenerate, so no engine starts; it writes its records
    assert ingest_main(["build", f"--manifest={manifest_path}", f"run.workdir={folder / 'work'}",
                        f"run.target={tiny_target}", f"run.store={uri}"]) == 0
    prov = json.loads((folder / "work" / "ingest" / "provenance.json").read_text())
    assert prov["outputs"] == {"store": uri, "table": store.PROMPTS, "version": version}
    assert {k: prov["inputs"].get(k) for k in _target_hashes(tiny_target)} == _target_hashes(tiny_target)
    assert prov["inputs"]["manifest_hash"] == manifest.content_hash()
    # the weights are those the table's own lineage names as the responses' target
    assert prov["inputs"]["weights_sha256"] == policy.target_id(str(tiny_target))


@pytest.mark.timeout(600)
def test_capture_provenance_names_the_features_version_it_wrote_and_the_targets_hashes(tmp_path, tiny_target):
    work = tmp_path / "a run"
    uri = fs_helpers.prompts_store(work, fs_helpers.prompt_rows(2, seed=1), tiny_target)
    prompts_version = store.latest_version(uri, store.PROMPTS)
    assert featurestore_main(["capture", f"run.workdir={work}", f"run.target={tiny_target}",
                              "featurestore.engine.max_model_len=64"]) == 0
    stats = json.loads((work / "featurestore" / "stats.json").read_text())
    prov = json.loads((work / "featurestore" / "provenance.json").read_text())
    written = store.latest_version(uri, store.FEATURES)
    assert stats["captured"] == 2 and stats["features_table_version"] == written
    assert prov["outputs"] == {"store": uri, "table": store.FEATURES, "version": written,
                               "feature_set_id": stats["feature_set_id"], "reused": False}
    assert {k: prov["inputs"].get(k) for k in _target_hashes(tiny_target)} == _target_hashes(tiny_target)
    assert prov["inputs"]["prompts_version"] == prompts_version
    # the hashes are those of the table's own feature identity
    comps = schema.feature_meta(store.dataset(uri, store.FEATURES).schema).identity_components
    assert {k: comps[k] for k in ("weights_sha256", "tokenizer_sha256", "chat_template_sha256")} == \
        {k: prov["inputs"][k] for k in ("weights_sha256", "tokenizer_sha256", "chat_template_sha256")}


def test_a_module_run_that_hands_sys_argv_to_the_writer_records_python_dash_m(tmp_path):
    """``evaluate al|offline|throughput|parity`` hand ``sys.argv`` to the provenance writer: under
    ``python -m eaglenest.evaluate.cli`` its first word is the module file's absolute path (a machine's path,
    no command anyone types), which only ``argv=None`` turned into ``python -m <module>`` (QA pass 7, train)."""
    pkg = tmp_path / "mods"
    pkg.mkdir()
    (pkg / "prov_cmd_qa8.py").write_text(
        "import sys\nfrom eaglenest.provenance import write_provenance\n"
        "write_provenance(sys.argv[1], config={}, argv=sys.argv)\n")
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    out = tmp_path / "out dir"
    proc = subprocess.run([sys.executable, "-m", "prov_cmd_qa8", str(out), "al"], cwd=cwd, timeout=120,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(pkg)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    argv = json.loads((out / "provenance.json").read_text())["argv"]
    assert argv == ["python", "-m", "prov_cmd_qa8", str(out), "al"], argv
