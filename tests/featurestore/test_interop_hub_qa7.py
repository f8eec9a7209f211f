"""The hub, seventh pass (hostile user): what a peer's dump or a recipe key can do to an import or an
export that the earlier passes did not try."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import interop_helpers as I
from interop_helpers import base  # noqa: F401  (a fixture: the table every test starts from)
from eaglenest.errors import SchemaError
from eaglenest.featurestore.interop import source, specforge


def _foreign_specforge(base, name: str = "sf") -> Path:
    """A SpecForge export of the ``base`` table as SpecForge itself writes it: no eaglenest record, no
    sample lines, no ``eaglenest_last_hidden`` (the import then divides by the final-norm weight)."""
    uri, target, tmp = base
    out = tmp / name
    specforge.export(source.open_source(uri, "features"), out, target=target)
    (out / source.EXPORT_RECORD).unlink()
    (out / source.SAMPLES).unlink()
    for path in out.rglob("*.ckpt"):
        data = torch.load(path, weights_only=True)
        data.pop(specforge.PRENORM_KEY)
        torch.save(data, path)
    return out


# -- 1: run.target_keys.norm naming a tensor that is not the final norm -----------------------------

def test_a_norm_key_of_another_shape_is_one_line_on_import(base):
    """Was a RuntimeError traceback from ``hs / weight`` in the middle of the import (export refused the
    same key in one line): the weight is [V, H], not [H]."""
    uri, target, tmp = base
    dump = _foreign_specforge(base)
    with pytest.raises(SchemaError, match=r"final norm of shape \[64, 8\], the dump's hidden size is 8"):
        specforge.import_dump(dump, uri, "x", target=target, layer_ids=[2, 4, 5],
                              norm_key="model.embed_tokens.weight")
    assert I.versions(uri, "x") is None  # nothing was created
    # the right key imports, and norm(last) gives SpecForge's hidden_state back
    specforge.import_dump(dump, uri, "x", target=target, layer_ids=[2, 4, 5], norm_key="model.norm.weight")
    assert len(I.table_rows(uri, "x")) == 5
