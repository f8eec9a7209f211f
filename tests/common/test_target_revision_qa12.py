"""Pinning a hub target's revision (hostile pass 12): ``run.target_revision``.

A target named by hub id was read at whatever the local Hugging Face cache's ``refs/main`` pointed to: no
recipe key asked for another revision, so a user who wanted revision X of ``acme/tiny`` could not ask. The
key pins it for every loader (``eaglenest.target.local_dir``, ``eaglenest.hf``'s transformers loaders, the
engine's ``revision`` / ``tokenizer_revision``), the feature identity and the prompts' lineage record the
commit it resolves to, a local folder with a revision is refused, and a revision the cache lacks is one line
naming it. Capture/train (``policy``) and export/serving (``serve.target_check``) compare revisions through
one function. Offline: a fake cache in tmp_path holding two snapshots whose config and tokenizer differ."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest

FS_TESTS = Path(__file__).resolve().parents[1] / "featurestore"
if str(FS_TESTS) not in sys.path:
    sys.path.insert(0, str(FS_TESTS))

import fs_helpers as H  # noqa: E402

from eaglenest import target as T  # noqa: E402
from eaglenest.errors import ConfigError  # noqa: E402
from eaglenest.featurestore.capture import identity, policy  # noqa: E402
from eaglenest.featurestore.cli import main as featurestore_main  # noqa: E402
from eaglenest.hf import check_remote_code, load_config, load_tokenizer, revision_kwargs  # noqa: E402
from eaglenest.ingest.cli import main as ingest_main  # noqa: E402
from eaglenest.recipe import load_recipe  # noqa: E402
from eaglenest.runconfig import RunConfig  # noqa: E402
from eaglenest.serve.target_check import check_target_weights  # noqa: E402
from eaglenest.train.target import load_target_tensors  # noqa: E402

HUB = "acme/tiny"
MAIN, OTHER, ABSENT = "a" * 40, "b" * 40, "c" * 40


@pytest.fixture
def hub_cache(tmp_path, tiny_target, monkeypatch):
    """An offline Hugging Face cache holding ``acme/tiny`` at two commits: ``refs/main`` -> MAIN (the tiny
    target as is) and ``refs/v2`` -> OTHER (another rms_norm_eps and model_max_length). No revision pinned."""
    import huggingface_hub.constants

    cache = tmp_path / "hub cache"  # a blank in the path too
    repo = cache / "models--acme--tiny"
    shutil.copytree(tiny_target, repo / "snapshots" / MAIN)
    other = repo / "snapshots" / OTHER
    shutil.copytree(tiny_target, other)
    for name, key, value in (("config.json", "rms_norm_eps", 1e-3), ("tokenizer_config.json", "model_max_length", 777)):
        data = json.loads((other / name).read_text())
        data[key] = value
        (other / name).write_text(json.dumps(data))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(OTHER)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(T, "_PINNED", {})  # nothing pinned before, nothing left pinned after
    monkeypatch.chdir(tmp_path)
    return repo


def _pinned(root: Path, revision: str, *more: str) -> RunConfig:
    """The run section of a recipe naming ``acme/tiny`` at ``revision``, registered as a command does."""
    run = load_recipe(root / "recipes" / "toy.yaml", [f"run.target={HUB}", f"run.target_revision={revision}",
                                                      *more]).run
    run.register_storage()  # what eaglenest.launch.execute calls once it resolved the recipe
    return run


def _main_values(tiny_target) -> tuple[float, int]:
    """What refs/main's snapshot (the tiny target as is) says, read from its files, not from a loader: each
    differs from the other snapshot's, so a loader reading the wrong one is seen."""
    eps = json.loads((Path(tiny_target) / "config.json").read_text())["rms_norm_eps"]
    max_len = json.loads((Path(tiny_target) / "tokenizer_config.json").read_text())["model_max_length"]
    assert (eps, max_len) != (1e-3, 777) and eps != pytest.approx(1e-3) and max_len != 777
    return eps, max_len


def test_the_key_defaults_to_the_cache_main(hub_cache, root, tiny_target):
    main_eps, main_len = _main_values(tiny_target)
    run = _pinned(root, "")
    assert run.target_revision == "" and RunConfig().target_revision == ""
    assert T.local_dir(HUB) == hub_cache / "snapshots" / MAIN
    assert load_config(HUB, trust_remote_code=False).rms_norm_eps == pytest.approx(main_eps)
    assert load_tokenizer(HUB, trust_remote_code=False).model_max_length == main_len
    assert revision_kwargs(HUB) == {}
    assert identity.hub_revision(HUB) == MAIN


@pytest.mark.parametrize("revision", ["v2", OTHER])
def test_a_pinned_revision_is_what_every_loader_reads(hub_cache, root, revision, tiny_target):
    main_eps, _ = _main_values(tiny_target)
    run = _pinned(root, revision)
    assert run.target_revision == revision
    assert T.local_dir(HUB) == hub_cache / "snapshots" / OTHER
    assert T.read_config(HUB)["rms_norm_eps"] == pytest.approx(1e-3)
    assert load_config(HUB, trust_remote_code=False).rms_norm_eps == pytest.approx(1e-3)
    assert load_tokenizer(HUB, trust_remote_code=False).model_max_length == 777
    assert load_target_tensors(HUB, only=("norm",))["rms_norm_eps"] == pytest.approx(1e-3)  # train run's read
    # vLLM's LLM(...) takes both (the engine's kwargs and `vllm serve --revision` are built from these).
    assert revision_kwargs(HUB) == {"revision": revision, "tokenizer_revision": revision, "code_revision": revision}
    # The identity and provenance record the commit the revision resolves to, not the branch name.
    comps = identity.components(target=HUB, layer_ids=[2, 4, 5], last_layer_id=8, dtype="float32", storage="raw",
                                sample_ids=["a0"], gen_params_ids=["g0"])
    assert comps["target_revision"] == OTHER
    assert identity.target_record(HUB)["target_revision"] == OTHER
    assert policy.lineage_record(HUB)["target_revision"] == OTHER
    assert identity.KEYS["target_revision"] == "run.target_revision"
    _pinned(root, "")  # unpinned again (the next command of this process): the cache's main
    assert load_config(HUB, trust_remote_code=False).rms_norm_eps == pytest.approx(main_eps)
    assert identity.hub_revision(HUB) == MAIN


def test_the_engine_keywords_are_vllms_own(hub_cache, root):
    """What revision_kwargs gives is what vllm.LLM / `vllm serve` take (EngineArgs' fields), not a name
    vLLM drops or refuses."""
    import dataclasses as dc

    from vllm.engine.arg_utils import EngineArgs

    _pinned(root, "v2")
    assert set(revision_kwargs(HUB)) <= {f.name for f in dc.fields(EngineArgs)}
    assert set(revision_kwargs(HUB)) == {"revision", "tokenizer_revision", "code_revision"}


def test_a_short_commit_id_the_cache_holds_is_written_out(hub_cache, root):
    """The hub and git show a commit as 7-12 hex digits; transformers and vLLM take a full one only, so a
    short id whose snapshot is cached was "no such revision" offline."""
    (hub_cache / "snapshots" / ("b" * 7 + "0" * 33)).mkdir()  # another commit sharing 7 digits
    run = _pinned(root, "b" * 9)
    assert run.target_revision == "b" * 9  # the recipe keeps what was typed; the loaders get the commit
    assert T.pinned_revision(HUB) == OTHER and revision_kwargs(HUB)["revision"] == OTHER
    assert load_config(HUB, trust_remote_code=False).rms_norm_eps == pytest.approx(1e-3)
    assert identity.hub_revision(HUB) == OTHER
    _pinned(root, "b" * 7)  # abbreviates two snapshots: as typed, refused as the cache lacks it
    with pytest.raises(ConfigError, match=r"^run\.target_revision: bbbbbbb: acme/tiny has no such revision"):
        load_config(HUB, trust_remote_code=False)


def test_a_revision_the_cache_lacks_is_one_line_naming_it(hub_cache, root):
    _pinned(root, ABSENT)
    want = (f"run.target_revision: {ABSENT}: {HUB} has no such revision in the local Hugging Face cache "
            f"(a branch, tag or commit of it: fetch it with `hf download {HUB} --revision {ABSENT}`, or leave "
            "run.target_revision empty for the cache's main)")
    for load in (load_config, load_tokenizer, check_remote_code):
        with pytest.raises(ConfigError) as err:
            load(HUB, trust_remote_code=False)
        assert str(err.value) == want
    with pytest.raises(ConfigError) as err:  # what train run and serve export read (the cache's main is there)
        T.read_config(HUB)
    assert str(err.value) == want
    assert identity.hub_revision(HUB) == ABSENT  # not resolvable: recorded as given


def test_the_cli_refuses_a_missing_revision_before_writing(hub_cache, root, tmp_path, capsys):
    work = tmp_path / "work"
    code = ingest_main(["build", "--recipe", str(root / "recipes" / "toy.yaml"), f"run.workdir={work}",
                        f"ingest.manifest={root / 'recipes' / 'manifests' / 'toy.yaml'}", f"run.target={HUB}",
                        "run.target_revision=nosuchbranch"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"ingest: error: run.target_revision: nosuchbranch: {HUB} has no such revision in the local "
                   f"Hugging Face cache (a branch, tag or commit of it: fetch it with `hf download {HUB} --revision "
                   "nosuchbranch`, or leave run.target_revision empty for the cache's main)"], err
    assert not (work / "store").exists()


def test_a_local_folder_has_no_revision(root, tiny_target, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_target, tmp_path / "models" / "tiny")
    for target in (str(tiny_target), "models/tiny", "./nowhere", "/abs/path/model"):
        with pytest.raises(ConfigError) as err:
            RunConfig(target=target, target_revision="v2")
        assert str(err.value) == (f"run.target_revision: 'v2' pins a revision, but run.target {target} is a local "
                                  "folder, which has no revisions (leave run.target_revision empty, or name the "
                                  "target by its hub id)")
    with pytest.raises(ConfigError, match=r"^run\.target_revision: 'v2' pins a revision, but run\.target models/tiny"):
        load_recipe(root / "recipes" / "toy.yaml", ["run.target=models/tiny", "run.target_revision=v2"])


@pytest.mark.parametrize("revision", ["../../../etc", "a b", "-x", "main/", "x\ty", "/abs", "a..b"])
def test_a_revision_that_names_no_git_ref_is_refused(revision):
    with pytest.raises(ConfigError) as err:
        RunConfig(target=HUB, target_revision=revision)
    assert str(err.value).startswith("run.target_revision: a branch, tag or commit of the hub id run.target names, "
                                     "got "), err.value


# -- one comparison of revisions: capture/train (policy) and export/serving (target_check) ---------------


def _captured_at_main() -> dict:
    return identity.components(target=HUB, layer_ids=[2, 4, 5], last_layer_id=8, dtype="float32", storage="raw",
                               sample_ids=["a0"], gen_params_ids=["g0"])


def test_features_of_main_are_refused_once_another_revision_is_pinned(hub_cache, root, tmp_path, caplog):
    comps = _captured_at_main()
    assert comps["target_revision"] == MAIN
    meta = dataclasses.replace(H.meta(target=HUB), identity=json.dumps(comps))
    info = {"target": HUB, "target_weights_sha256": f"hub:{HUB}", "feature_meta": {"identity": json.dumps(comps)}}
    ckpt = tmp_path / "train" / "checkpoint.json"
    policy.check_features(meta, HUB, off_policy=False, stage="train run")  # the same revision: accepted
    check_target_weights(info, HUB, ckpt=ckpt, off_policy=False)
    _pinned(root, "v2")
    line = (f"run.target: {HUB} is at revision {OTHER[:12]} (run.target_revision=v2), not at {MAIN[:12]}, the "
            "revision the features were captured at")
    with pytest.raises(ConfigError) as err:
        policy.check_features(meta, HUB, off_policy=False, stage="train run")
    assert str(err.value).startswith(f"train run: {line} (the features table's identity): other weights "
                                     f"(run.target_revision={MAIN} reads those)."), err.value
    with pytest.raises(ConfigError) as err:
        check_target_weights(info, HUB, ckpt=ckpt, off_policy=False)
    assert str(err.value).startswith(f"{line} (the feature identity of "), err.value
    with caplog.at_level(logging.WARNING):
        policy.check_features(meta, HUB, off_policy=True, stage="train run")
    assert any(r.getMessage().startswith(f"train run: {line}") for r in caplog.records), caplog.text
    # Recorded before revisions were: unknown, a warning from both, never a refusal.
    old = json.dumps({k: v for k, v in comps.items() if k != "target_revision"})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        policy.check_features(dataclasses.replace(meta, identity=old), HUB, off_policy=False, stage="train run")
        check_target_weights({**info, "feature_meta": {"identity": old}}, HUB, ckpt=ckpt, off_policy=False)
    unknown = [r.getMessage() for r in caplog.records if "records no revision" in r.getMessage()]
    assert len(unknown) == 2 and all(OTHER[:12] in w for w in unknown), caplog.text


def test_responses_generated_at_main_are_refused_at_another_revision(hub_cache, root, tmp_path):
    """The prompts table's lineage records the revision its responses were generated at: capture or train
    at another one (same hub id) trained a draft on another model's outputs without a word."""
    assert policy.lineage_record(HUB)["target_revision"] == MAIN
    uri = H.prompts_store(tmp_path, H.prompt_rows(2), HUB)  # generated at main
    policy.check_prompts(uri, HUB, off_policy=False, stage="featurestore capture")
    _pinned(root, "v2")
    with pytest.raises(ConfigError) as err:
        policy.check_prompts(uri, HUB, off_policy=False, stage="featurestore capture")
    assert str(err.value).startswith(
        f"featurestore capture: run.target: {HUB} is at revision {OTHER[:12]} (run.target_revision=v2), not at "
        f"{MAIN[:12]}, the revision the responses were generated at (the lineage of the responses in {uri})"), err.value
    policy.check_prompts(uri, HUB, off_policy=True, stage="featurestore capture")  # a warning
    _pinned(root, MAIN)  # pinned to the commit main resolves to: the same revision
    policy.check_prompts(uri, HUB, off_policy=False, stage="featurestore capture")


def test_capture_at_another_revision_than_the_responses_is_refused_by_the_cli(hub_cache, root, tmp_path, capsys):
    """End to end through the command: the recipe's pin reaches the lineage check (no engine starts)."""
    work = tmp_path / "work"
    H.prompts_store(work, H.prompt_rows(2), HUB)  # responses generated at main (MAIN)
    argv = ["capture", "--recipe", str(root / "recipes" / "toy.yaml"), f"run.workdir={work}", f"run.target={HUB}"]
    code = featurestore_main([*argv, "run.target_revision=v2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"featurestore: error: featurestore capture: run.target: {HUB} is at revision "
                             f"{OTHER[:12]} (run.target_revision=v2), not at {MAIN[:12]}, the revision the responses "
                             "were generated at"), err
    assert not (work / "featurestore").exists()


def test_a_branch_recorded_before_it_was_cached_is_its_commit_once_it_is(hub_cache, root, tmp_path):
    """Online, `ingest build` records a pinned branch as given while its snapshot is not cached yet (its engine
    downloads it); `featurestore capture` then reads its commit. The same revision, not another one."""
    (hub_cache / "refs" / "v2").unlink()
    _pinned(root, "v2")
    assert policy.lineage_record(HUB)["target_revision"] == "v2"  # not resolvable yet: as given
    uri = H.prompts_store(tmp_path, H.prompt_rows(2), HUB)
    (hub_cache / "refs" / "v2").write_text(OTHER)  # downloaded since
    assert identity.hub_revision(HUB) == OTHER
    policy.check_prompts(uri, HUB, off_policy=False, stage="featurestore capture")
    _pinned(root, "")  # main now: not the commit v2 names
    with pytest.raises(ConfigError, match=r"is at revision aaaaaaaaaaaa in the local Hugging Face cache, not at v2,"):
        policy.check_prompts(uri, HUB, off_policy=False, stage="featurestore capture")


def test_the_engine_and_the_server_read_the_pinned_revision(hub_cache, root):
    """The pin reaches vLLM: the in-process engine's keyword arguments and `vllm serve`'s command line."""
    import dataclasses as dc

    from eaglenest.engine import EngineConfig, engine_kwargs
    from eaglenest.serve.server import server_argv

    cfg = dc.replace(EngineConfig(), dtype="float32")

    def served(argv: list[str]) -> dict[str, str]:
        return {flag: argv[i + 1] for i, flag in enumerate(argv) if flag.endswith("revision")}

    def argv() -> list[str]:
        return server_argv(HUB, port=1, draft=None, num_speculative_tokens=3, memory_fraction=0.5, max_model_len=256,
                           dtype="float32")

    assert not {"revision", "tokenizer_revision", "code_revision"} & set(engine_kwargs(cfg, HUB))
    assert served(argv()) == {}
    _pinned(root, "v2")
    kwargs = engine_kwargs(cfg, HUB)
    assert (kwargs["revision"], kwargs["tokenizer_revision"], kwargs["code_revision"]) == ("v2", "v2", "v2")
    assert served(argv()) == {"--revision": "v2", "--tokenizer-revision": "v2", "--code-revision": "v2"}
