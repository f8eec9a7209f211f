"""One sample of a features table as the reader hands it out (:class:`Sample`), and where its
tensors go when the caller gives destinations (:class:`Into`)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import numpy as np
import pyarrow as pa

from eaglenest.errors import SchemaError
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.read.pread import BufferPool


def torch_module():
    import torch

    return torch


def view_bytes(buf, np_dtype=np.uint8):
    """A torch tensor viewing ``buf`` (read-only Arrow memory; never written through)."""
    torch = torch_module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array": the views are read only
        return torch.from_numpy(np.frombuffer(buf, np_dtype))


def binary_value(col: pa.ChunkedArray):
    """The single value of a one-row ``large_binary`` column as a zero-copy Arrow buffer slice."""
    chunk = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    _, offsets, data = chunk.buffers()
    offs = np.frombuffer(offsets, np.int64)[chunk.offset:chunk.offset + 2]
    return data.slice(int(offs[0]), int(offs[1] - offs[0]))


def list_values(col: pa.ChunkedArray) -> np.ndarray:
    chunk = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    return chunk.flatten().to_numpy(zero_copy_only=True)


@dataclasses.dataclass
class Into:
    """Where a sample's tensors go: ``aux`` ``[n, n_aux, H]`` and ``last`` ``[n, H]`` (contiguous,
    any float dtype, ``n`` <= the sample's tokens), aux layers taken in ``order`` (table layer
    positions; None = table order)."""

    aux: object
    last: object
    order: Sequence[int] | None = None


@dataclasses.dataclass
class Sample:
    """One row of a features table, its tensors viewing the Arrow buffers it keeps alive."""

    index: int                 # dataset offset (``take`` index)
    meta: S.FeatureMeta
    input_ids: np.ndarray      # int32 [T], view
    loss_mask: np.ndarray      # uint8 [T], view
    _aux: object               # buffer of the aux value (Arrow buffer or numpy bytes); None: read into a destination
    _last: object              # buffer of the last value
    _table: pa.Table           # owner of the small columns' buffers
    _pool: "BufferPool | None" = None
    _owned: tuple = ()         # pooled buffers to hand back on release()

    def release(self) -> None:
        """Hand this sample's buffers back to the reader's pool (``recycle=True``): its tensors
        must not be used afterwards. Without a pool this only drops the references."""
        if self._pool is not None:
            for b in self._owned:
                self._pool.put(b)
        self._owned, self._pool, self._aux, self._last = (), None, None, None

    def ids_tensor(self):
        """``input_ids`` as an int32 torch tensor viewing the Arrow buffer."""
        return view_bytes(self.input_ids, np.int32)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_aux(self) -> int:
        return len(self.meta.layer_ids)

    def _stored(self, buf, shape: tuple[int, ...], col: str):
        """raw: a view of the stored dtype; fp8: (scales [rows] fp32, codes [rows, H] e4m3) views."""
        torch = torch_module()
        m = self.meta
        if buf is None:
            raise SchemaError(f"row {self.index} was read into a destination; its values are not held")
        if m.storage == "raw":
            t = view_bytes(buf).view(stored_torch_dtype(m))
            if t.numel() != int(np.prod(shape)):
                raise self._size_error(col, buf, shape)
            return t.view(shape)
        if m.storage == "fp8_e4m3":
            rows = int(np.prod(shape[:-1]))
            if memoryview(buf).nbytes != rows * (4 + shape[-1]):
                raise self._size_error(col, buf, shape)
            scales, codes = S.fp8_parts(buf, rows, shape[-1])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return (torch.from_numpy(scales).view(*shape[:-1]),
                        torch.from_numpy(codes).view(torch.float8_e4m3fn).view(shape))
        raise SchemaError(f"unknown storage mode {m.storage!r}")

    def _size_error(self, col: str, buf, shape: tuple[int, ...]) -> SchemaError:
        """A stored value whose size is not the one its row's ``num_tokens`` implies (a writer that did
        not check), named by row and column as the read straight into a destination names it."""
        m = self.meta
        return SchemaError(f"row {self.index}: {col} holds {memoryview(buf).nbytes} bytes, not a value of shape "
                           f"{shape} ({m.dtype} {m.storage}); `featurestore verify` names the row by sample_id")

    def aux_stored(self):
        """raw: ``[T, n_aux, H]`` view in the stored dtype (table layer order)."""
        return self._stored(self._aux, (self.num_tokens, self.num_aux, self.meta.hidden_size), "aux_hidden")

    def last_stored(self):
        return self._stored(self._last, (self.num_tokens, self.meta.hidden_size), "last_hidden")

    def _layer_order(self, order) -> list[int]:
        """``order`` as table layer positions (None: table order); a position outside the table's aux
        layers (a negative one would silently take a layer counted from the end) is refused by row."""
        idx = list(range(self.num_aux)) if order is None else [int(j) for j in order]
        bad = [j for j in idx if not 0 <= j < self.num_aux]
        if bad:
            raise SchemaError(f"row {self.index}: layer order {idx} names position {bad[0]}, outside the table's "
                              f"{self.num_aux} aux layers (0..{self.num_aux - 1})")
        return idx

    def _fit(self, out, tail: tuple[int, ...], col: str) -> int:
        """The tokens ``out`` takes (its first dimension); a destination longer than the sample (a
        copy would repeat its tokens by broadcasting) or of another shape is refused by row."""
        n = out.shape[0]
        if n > self.num_tokens or tuple(out.shape[1:]) != tail:
            raise SchemaError(f"row {self.index}: destination {tuple(out.shape)} for {col} does not fit a sample "
                              f"of {self.num_tokens} tokens (wants [n <= {self.num_tokens}, "
                              f"{', '.join(map(str, tail))}])")
        return n

    def aux_into(self, out, *, order=None):
        """Write the first ``n = out.shape[0]`` tokens' aux states into ``out`` (``[n, n_aux, H]``,
        float), layers taken in ``order`` (a list of table layer positions; None = table order).
        One converting copy per layer at most; fp8 is dequantised in place."""
        idx = self._layer_order(order)
        n = self._fit(out, (len(idx), self.meta.hidden_size), "aux_hidden")
        src = self.aux_stored()
        if self.meta.storage == "raw":
            if idx == list(range(self.num_aux)):
                out.copy_(src[:n])
            elif out.dtype == src.dtype and out.is_contiguous():  # one gather, no per-layer passes
                torch_module().index_select(src[:n], 1, torch_module().as_tensor(idx), out=out)
            else:
                for k, j in enumerate(idx):
                    out[:, k].copy_(src[:n, j])
            return out
        scales, codes = src
        for k, j in enumerate(idx):
            out[:, k].copy_(codes[:n, j]).mul_(scales[:n, j, None])
        return out

    def last_into(self, out):
        """Write the first ``out.shape[0]`` tokens' last hidden states into ``out`` (``[n, H]``)."""
        n = self._fit(out, (self.meta.hidden_size,), "last_hidden")
        src = self.last_stored()
        if self.meta.storage == "raw":
            return out.copy_(src[:n])
        scales, codes = src
        return out.copy_(codes[:n]).mul_(scales[:n, None])


def stored_torch_dtype(meta: S.FeatureMeta):
    """The torch dtype of a raw-storage table's values."""
    torch = torch_module()
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[meta.dtype]
