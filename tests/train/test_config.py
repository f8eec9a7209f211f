"""The train section: nested sections validate with their dotted names; the resume fingerprint reads
states saved with the earlier flat keys."""

from __future__ import annotations

import dataclasses

import pytest

from eaglenest.config import apply_overrides, build
from eaglenest.errors import ConfigError
from eaglenest.train import state as S
from eaglenest.train.config import RENAMED, SelectConfig, StateConfig, StreamConfig, TrainConfig


def load(*overrides: str) -> TrainConfig:
    return build(TrainConfig, apply_overrides({}, list(overrides)).get("train"), where="train")


@pytest.mark.parametrize("override, message", [
    ("train.stream.depth=0", "train.stream.depth: must be >= 1"),
    ("train.stream.engines=0", "train.stream.engines: must be >= 1"),
    ("train.stream.timeout_s=0", "train.stream.timeout_s: a number of seconds > 0"),
    ("train.select.every_steps=-1", "train.select.every_steps: must be >= 0"),
    ("train.select.prompts_per_domain=0", "train.select.prompts_per_domain: must be >= 1"),
    ("train.state.keep=0", "train.state.keep: must be >= 1"),
    ("train.state.resume=maybe", "train.state.resume:"),
    ("train.stream=4", "train.stream: expected a mapping"),
    ("train.stream_depth=4", "train.stream_depth: renamed to train.stream.depth"),
])
def test_section_errors_name_the_dotted_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load(override)


@pytest.mark.parametrize("family", ["peagle", "dflash"])
def test_parallel_families_are_refused_on_the_stream_until_shown_to_train_there(family):
    with pytest.raises(ConfigError, match=rf"train\.family={family}: the streaming bypass"):
        load("train.source=stream", f"train.family={family}")
    assert load("train.source=stream").family == "eagle3"
    assert load(f"train.family={family}").source == "table"


def test_gloo_stream_address_is_checked_at_config_time():
    with pytest.raises(ConfigError, match=r"train\.stream\.addr"):
        load("train.source=stream", "train.stream.transport=gloo", "train.stream.addr=nohost")
    assert load("train.source=stream", "train.stream.transport=gloo",
                "train.stream.addr=10.0.0.5:29650").stream.addr == "10.0.0.5:29650"
    assert load("train.stream.transport=gloo").stream.transport == "gloo"  # table source: unused, unchecked


def test_renamed_table_covers_the_sections():
    """Every key of the earlier flat layout maps onto a field of the new sections, and back."""
    sections = {"stream": StreamConfig, "select": SelectConfig, "state": StateConfig}
    new = {f"{name}.{f.name}" for name, cls in sections.items() for f in dataclasses.fields(cls)}
    assert set(RENAMED.values()) == new
    assert not set(RENAMED) & {f.name for f in dataclasses.fields(TrainConfig)}


def test_fingerprint_matches_a_state_saved_with_flat_keys(tmp_path):
    """A state saved before the sections (flat train keys in its fingerprint) still resumes; a
    trajectory key that differs is named by its new dotted name."""
    cfg = TrainConfig(source="stream", stream=StreamConfig(transport="gloo", engines=2, addr="10.0.0.5:29650"))
    now = S.fingerprint(cfg, table_version=3, store_uri="s", target="t", seed=0)
    assert "stream.engines" in now["train"] and "state.every_steps" not in now["train"]  # free keys left out
    flat = {k.replace(".", "_") if k.startswith("stream.") else k: v for k, v in now["train"].items()}
    flat = {k: v for k, v in flat.items() if not k.startswith("draft.")}
    flat["draft"] = {f.name: 0 for f in dataclasses.fields(cfg.draft)}
    flat["resume"], flat["keep_states"] = "auto", 2  # free keys of old states were never stored, harmless
    saved = {**now, "train": flat}
    info = {"fingerprint": saved, "step": 4, "finished": False}
    assert S.resolve(info, now, tmp_path) is info
    other = S.fingerprint(dataclasses.replace(cfg, stream=StreamConfig(transport="gloo", engines=3, addr="10.0.0.5:29650")),
                          table_version=3, store_uri="s", target="t", seed=0)
    with pytest.raises(ConfigError, match=r"train\.stream\.engines 2 -> 3"):
        S.resolve(info, other, tmp_path)


def test_stream_source_gets_the_whole_stream_section(monkeypatch):
    """The data source is chosen once from train.source; the stream gets every train.stream key
    (before, transport/engines/addr/timeout_s did not reach it and the gloo transport fell back to unix)."""
    from eaglenest.train import source

    seen = {}
    monkeypatch.setattr(source, "StreamShards", lambda uri, **kw: seen.update(kw, uri=uri) or "stream")
    monkeypatch.setattr(source, "FeatureShards", lambda uri, **kw: seen.update(kw, uri=uri) or "table")
    cfg = load("train.source=stream", "train.stream.transport=gloo", "train.stream.engines=3",
               "train.stream.addr=10.0.0.5:29650", "train.stream.timeout_s=60", "train.stream.depth=5")
    assert source.open_source(cfg, "s", table="features", seed=1, target_dir="t", featurestore=None) == "stream"
    assert {k: seen[k] for k in ("transport", "engines", "addr", "timeout_s", "depth")} == \
        {"transport": "gloo", "engines": 3, "addr": "10.0.0.5:29650", "timeout_s": 60.0, "depth": 5}
    seen.clear()
    assert source.open_source(load("train.table_version=2"), "s", table="second", seed=1, target_dir="t",
                              featurestore=None) == "table"
    assert (seen["version"], seen["table"], seen["seed"]) == (2, "second", 1)


def test_a_table_run_resumes_whatever_its_unread_stream_keys_say(tmp_path):
    """train.source=table never reads train.stream: a changed stream key (or one saved by a state from
    before) refused the resume of an unfinished table run ("train.stream.timeout_s 1800 -> 60")."""
    cfg = TrainConfig()
    saved = S.fingerprint(cfg, table_version=3, store_uri="s", target="t", seed=0)
    saved["train"].update({"stream.timeout_s": 1800.0, "stream.engines": 1})  # as states saved before kept them
    info = {"fingerprint": saved, "step": 4, "finished": False}
    now = S.fingerprint(dataclasses.replace(cfg, stream=StreamConfig(timeout_s=60.0, engines=4)),
                        table_version=3, store_uri="s", target="t", seed=0)
    assert not any(k.startswith("stream.") for k in now["train"])
    assert S.resolve(info, now, tmp_path) is info
    streamed = S.fingerprint(dataclasses.replace(cfg, source="stream"), table_version=3, store_uri="s", target="t",
                             seed=0)
    with pytest.raises(ConfigError, match=r"train\.source 'table' -> 'stream'"):
        S.resolve(info, streamed, tmp_path)
