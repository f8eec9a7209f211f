"""The hub's third mutation audit: what survived the interop tests, checked from the documented
behaviour (docs/export.md, docs/import.md) rather than through eaglenest's own reader: a killed export's
leftovers are swept by the next export to the same ``--out`` (and a live one's are not), and a foreign
dump of another aux layer count than EAGLE-3's usual three (SpecForge: the aux width over H; speculators:
the hs file's layers less the last) comes in layer by layer, a file of another count being refused first."""

from __future__ import annotations

import subprocess
import sys

import datasets
import pytest
import torch
from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor, quantize_tensor_to_fp8
from safetensors.torch import save_file

import interop_helpers as I
from interop_helpers import base  # noqa: F401  (a fixture: the table every test starts from)
from eaglenest.errors import SchemaError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.interop import hf, source, specforge, speculators
from eaglenest.featurestore.interop.source import EXPORT_RECORD
from eaglenest.featurestore.table import store
from eaglenest.paths import pid_prefix


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_an_export_sweeps_what_a_killed_export_to_the_same_out_left(base):
    """docs/export.md: "the next export to --out removes what it left once its pid is gone"; a folder of a
    live process (this one: another export running now) stays."""
    uri, target, tmp = base
    dead = tmp / f"{pid_prefix('.out.partial-', _dead_pid())}x1"
    live = tmp / f"{pid_prefix('.out.partial-')}x2"
    for d in (dead, live):
        (d / "hidden_states").mkdir(parents=True)
        (d / "hidden_states" / "hs_0.safetensors").write_bytes(b"half a file")
    for peer, out in ((speculators, "out"), (specforge, "other")):
        peer.export(source.open_source(uri, "features"), tmp / out, target=target)
    assert not dead.exists(), "the killed export's folder is still beside --out"
    assert live.exists(), "a live process's folder was removed"
    assert (tmp / "out" / EXPORT_RECORD).is_file() and (tmp / "other" / EXPORT_RECORD).is_file()
    hf.export(source.open_source(uri, "features"), tmp / "hf")
    assert sorted(p.name for p in tmp.glob(".*partial-*")) == [live.name]


def _specforge_file(path, T: int, n_aux: int, *, seed: int) -> dict:
    """A SpecForge feature file as prepare_hidden_states.py writes it (bf16, aux layers concatenated on
    the last axis, layer after layer); returns its tensors."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, I.VOCAB, (T,), generator=g)
    aux = [torch.randn(T, I.HIDDEN, generator=g).to(torch.bfloat16) for _ in range(n_aux)]
    last = torch.randn(1, T, I.HIDDEN, generator=g).to(torch.bfloat16)
    d = {"input_ids": ids, "loss_mask": (torch.arange(T) % 2).long(),
         "hidden_state": torch.randn(1, T, I.HIDDEN, generator=g).to(torch.bfloat16),
         "aux_hidden_state": torch.cat(aux, dim=-1)[None], specforge.PRENORM_KEY: last}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(d, path)
    return {"ids": ids.tolist(), "aux": torch.stack(aux, dim=1)}  # [T, n_aux, H], the table's layout


@pytest.mark.parametrize("layer_ids", [[2, 5], [1, 3, 5, 7]])
def test_a_foreign_specforge_dump_of_another_aux_layer_count_comes_in(base, layer_ids):
    """The number of aux layers is the file's (its aux width over H), not EAGLE-3's usual 3: a dump of 2
    or 4 layers, named by as many featurestore.layer_ids, comes in with each layer in its place."""
    uri, target, tmp = base
    files = [_specforge_file(tmp / "sf" / f"rows_0-2000/data_{i}.ckpt", 3 + i, len(layer_ids), seed=i)
             for i in range(2)]
    summary = specforge.import_dump(tmp / "sf", uri, "peer", target=target, layer_ids=layer_ids)
    assert summary["layer_ids"] == layer_ids and summary["rows"] == 2
    got = {tuple(r["input_ids"]): r for r in I.table_rows(uri, "peer")}
    for f in files:
        r = got[tuple(f["ids"])]
        stored = S.torch_from_blob(r["aux_hidden"], tuple(f["aux"].shape), "bfloat16")
        assert torch.equal(stored.view(torch.int16), f["aux"].view(torch.int16))


def test_a_specforge_file_of_another_aux_layer_count_is_refused_before_anything_is_written(base):
    """One file of 2 aux layers among files of 3 (the same H and dtype): refused in the first pass,
    naming that file, with nothing written (not a table created, then a failure at that row)."""
    uri, target, tmp = base
    for i in range(3):
        _specforge_file(tmp / "sf" / f"rows_0-2000/data_{i}.ckpt", 4, 2 if i == 1 else 3, seed=i)
    with pytest.raises(SchemaError, match=r"data_1\.ckpt: \[n_aux, H, dtype\] = \[2, 8, 'bfloat16'\], the dump's "
                                          r"first file has \[3, 8, 'bfloat16'\]"):
        specforge.import_dump(tmp / "sf", uri, "peer", target=target, layer_ids=[2, 4, 5])
    assert not store.exists(uri, "peer")


@pytest.mark.parametrize("fp8", [False, True])
def test_a_foreign_speculators_dump_of_two_aux_layers_comes_in(base, fp8):
    """speculators' hs file holds [T, n_aux + 1, H] for any n_aux (``--target-layer-ids`` of two layers):
    the aux layers are the file's first n_aux, the last layer its last, whatever n_aux is; an FP8 file
    (hs_connectors' connector) too, dequantized as hs_connectors' own ``dequantize_fp8_tensor`` does."""
    uri, target, tmp = base
    dump = tmp / "spec"
    (dump / "hidden_states").mkdir(parents=True)
    g, rows, files = torch.Generator().manual_seed(0), [], []
    for i, T in enumerate((1, 5)):
        ids = torch.randint(0, I.VOCAB, (T,), generator=g)
        hs = torch.randn(T, 3, I.HIDDEN, generator=g).to(torch.float16)
        tensors = {"token_ids": ids, "hidden_states": hs}
        if fp8:
            codes, scales = quantize_tensor_to_fp8(hs)
            tensors = {"token_ids": ids, "hidden_states": codes, SCALES_KEY: scales}
            hs = dequantize_fp8_tensor(codes, scales)  # bfloat16: what speculators' trainer reads
        save_file(tensors, str(dump / f"hidden_states/hs_{i}.safetensors"))
        rows.append({"input_ids": ids.tolist(), "loss_mask": [1] * T, "seq_len": T})
        files.append((ids.tolist(), hs))
    datasets.Dataset.from_list(rows).save_to_disk(str(dump))
    summary = speculators.import_dump(dump, uri, "peer", target=target, layer_ids=[5, 2])
    dtype = "bfloat16" if fp8 else "float16"
    assert summary["layer_ids"] == [2, 5] and summary["dtype"] == dtype
    got = {tuple(r["input_ids"]): r for r in I.table_rows(uri, "peer")}
    for ids, hs in files:
        r, T = got[tuple(ids)], len(ids)
        assert torch.equal(S.torch_from_blob(r["aux_hidden"], (T, 2, I.HIDDEN), dtype), hs[:, :2])
        assert torch.equal(S.torch_from_blob(r["last_hidden"], (T, I.HIDDEN), dtype), hs[:, 2])
