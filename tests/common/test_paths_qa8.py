"""An output folder that is a symlink (the draft or a model kept on another disk) is written through
the link: the new output lands where the link points, and the link stays."""

from __future__ import annotations

import pytest

from eaglenest.errors import ConfigError
from eaglenest.paths import staged_dir


def _is_model(p):
    return (p / "config.json").is_file()


@pytest.mark.parametrize("earlier", ["a model", "empty", "missing"])
def test_an_output_folder_that_is_a_symlink_is_replaced_where_it_points(tmp_path, earlier):
    """Before: replacing an earlier output renamed the link over a fresh folder and failed after the
    whole build with "cannot write to .../draft (Is a directory)"."""
    disk, runs = tmp_path / "big disk", tmp_path / "runs"
    real = disk / "draft"
    disk.mkdir()
    runs.mkdir()
    if earlier != "missing":
        real.mkdir()
    if earlier == "a model":
        (real / "config.json").write_text("old")
        (real / "stale.bin").write_text("from the earlier output")
    link = runs / "draft"
    link.symlink_to(real, target_is_directory=True)
    with staged_dir(link, "--out", replaces=_is_model, error=ConfigError) as tmp:
        (tmp / "config.json").write_text("new")
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert sorted(p.name for p in real.iterdir()) == ["config.json"]
    assert (real / "config.json").read_text() == "new"
    assert sorted(p.name for p in runs.iterdir()) == ["draft"]  # no side folder or link left beside it
    assert sorted(p.name for p in disk.iterdir()) == ["draft"]


def test_a_failed_block_leaves_the_folder_behind_the_link_as_it_was(tmp_path):
    real = tmp_path / "disk" / "m"
    real.mkdir(parents=True)
    (real / "config.json").write_text("old")
    link = tmp_path / "m"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(RuntimeError, match="^killed mid-way$"):  # the block's own error, not another
        with staged_dir(link, "--out", replaces=_is_model, error=ConfigError) as tmp:
            (tmp / "config.json").write_text("half")
            raise RuntimeError("killed mid-way")
    assert link.is_symlink() and (link / "config.json").read_text() == "old"
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["m"]
