"""An object-store ``run.store`` whose key Lance and pyarrow would read differently is refused when
the recipe loads, naming ``run.store``, before any stage starts an engine or reads a table (it was
refused only when the store was first opened, minutes into ``ingest`` on a large pool)."""

from pathlib import Path

import pytest

from eaglenest.errors import ConfigError
from eaglenest.recipe import load_recipe

TOY = Path(__file__).resolve().parents[2] / "recipes" / "toy.yaml"


@pytest.mark.parametrize("uri, says", [("s3://b//dbl", "has an empty path segment (//)"),
                                       ("gs:///p", "names no bucket"),
                                       ("az://b/q?x", "holds '?', which Lance reads as URL syntax"),
                                       ("s3://b/x\ty", "holds a control character"),
                                       ("s3://b/p/..", "has a '.' or '..' path segment"),
                                       ("s3://b/./p", "has a '.' or '..' path segment")])
def test_bad_object_store_key_refused_at_load(tmp_path, uri, says):
    with pytest.raises(ConfigError) as info:
        load_recipe(TOY, [f"run.workdir={tmp_path}", f"run.store={uri}"])
    text = str(info.value)
    assert text.startswith("run.store: ") and says in text and "\n" not in text and "\t" not in text


def test_good_object_store_key_loads(tmp_path):
    recipe = load_recipe(TOY, [f"run.workdir={tmp_path}", "run.store=s3://bucket/some/prefix/"])
    assert recipe.run.store_uri.startswith("s3://bucket/some/prefix")
