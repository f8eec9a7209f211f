"""The feature-store contract: Arrow schemas declared once, versioned, validated on read and write.

Two tables live in a store (a LanceDB directory):

* ``prompts``: the prompt pool and its on-policy responses (written by ``ingest``).
* ``features``: one row per sample with token ids, the assistant loss mask and the target's hidden
  states (written by ``featurestore capture``).

Hidden states are stored in ``large_binary`` columns, one value per sample, encoded as Lance blob
columns (field metadata ``lance-encoding:blob``, schema version 2): the bytes lie contiguously in
the data file and a read returns their ``(position, size)``, so a reader can ``pread`` a value
straight into the tensor that will hold it (:mod:`eaglenest.featurestore.read.reader`); version-1 tables
(plain ``large_binary``, same bytes) are still read, through ``take``. Values: ``aux_hidden`` is
``[num_tokens, num_aux_layers, hidden_size]`` and ``last_hidden`` is ``[num_tokens, hidden_size]``.
Shape, dtype and storage mode are table-level metadata (``FeatureMeta``), so the per-row overhead is
one length. Two storage modes (``FeatureMeta.storage``):

* ``raw``: little-endian bytes of the target's own dtype (bf16, fp16 or fp32): any dtype round-trips
  bit-exactly and a read costs no conversion (readers view the Arrow buffer as a tensor).
* ``fp8_e4m3``: per-row scaled e4m3 (a row = one token of one layer, ``H`` values). The value is
  ``R`` little-endian fp32 scales followed by ``R x H`` e4m3 bytes (``R = T * num_layers``);
  ``x ~= e4m3 * scale`` with ``scale = absmax(row) / 448``. Half the bytes of bf16 (plus 4 bytes
  per row), a quarter of fp32; lossy (3 mantissa bits: relative error <= 2^-4 per element above the
  row's subnormal range).

Layer ids are in vLLM's convention (id 0 = embedding output, id L = output of the last block
before the final norm).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa

from eaglenest.config import short
from eaglenest.errors import SchemaError

#: Version of the ``features`` schema. 2: tensor columns are Lance blob columns (same bytes as 1).
SCHEMA_VERSION = 2
#: Feature-table versions this code reads (1: inline ``large_binary`` tensors, read with ``take``).
READABLE_VERSIONS = (1, 2)
#: The ``prompts`` schema has not changed since version 1.
PROMPTS_SCHEMA_VERSION = 1
#: Field metadata that makes Lance store a ``large_binary`` column as blobs.
BLOB_METADATA = {b"lance-encoding:blob": b"true"}

PROMPTS_SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("domain", pa.string(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("split", pa.string(), nullable=False),          # "train" | "heldout"
    pa.field("mode", pa.string(), nullable=False),           # "chat" | "raw"
    pa.field("messages_json", pa.string(), nullable=False),  # the conversation, JSON list of {role, content}
    pa.field("prompt_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("response_token_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("finish_reason", pa.string(), nullable=False),  # "" for held-out rows (not regenerated)
    pa.field("gen_params_id", pa.string(), nullable=False),
], metadata={"eaglenest.schema": "prompts", "eaglenest.schema_version": str(PROMPTS_SCHEMA_VERSION)})

FEATURES_SCHEMA = pa.schema([
    pa.field("sample_id", pa.string(), nullable=False),
    pa.field("domain", pa.string(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("split", pa.string(), nullable=False),
    pa.field("mode", pa.string(), nullable=False),
    pa.field("gen_params_id", pa.string(), nullable=False),
    pa.field("num_tokens", pa.int32(), nullable=False),
    pa.field("num_loss_tokens", pa.int32(), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
    pa.field("aux_hidden", pa.large_binary(), nullable=False, metadata=BLOB_METADATA),
    pa.field("last_hidden", pa.large_binary(), nullable=False, metadata=BLOB_METADATA),
], metadata={"eaglenest.schema": "features", "eaglenest.schema_version": str(SCHEMA_VERSION)})

#: Columns that hold tensors: excluded from ad-hoc queries unless asked for.
TENSOR_COLUMNS = ("aux_hidden", "last_hidden")

_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureMeta:
    """Table-level facts every reader needs to decode the tensor columns."""

    target: str
    layer_ids: tuple[int, ...]       # aux layers, vLLM convention
    last_layer_id: int               # = num_hidden_layers of the target
    hidden_size: int
    dtype: str                       # "float32" | "float16" | "bfloat16"
    feature_set_id: str = ""
    #: "raw": tensors in ``dtype``, bit-exact; "fp8_e4m3": e4m3 bytes + one fp32 scale per token row.
    storage: str = "raw"
    #: JSON of the identity components hashed into ``feature_set_id`` (see featurestore/capture/identity.py).
    identity: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "FeatureMeta":
        d = json.loads(text)
        d["layer_ids"] = tuple(d["layer_ids"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @property
    def identity_components(self) -> dict:
        return json.loads(self.identity) if self.identity else {}


def features_schema(meta: FeatureMeta) -> pa.Schema:
    """The features schema carrying ``meta`` in its metadata."""
    md = dict(FEATURES_SCHEMA.metadata)
    md[b"eaglenest.feature_meta"] = meta.to_json().encode()
    return FEATURES_SCHEMA.with_metadata(md)


def feature_meta(schema: pa.Schema) -> FeatureMeta:
    """The table's :class:`FeatureMeta`; metadata that is not JSON, lacks a key or holds a value of
    the wrong kind (a table another tool wrote or damaged) is a :class:`SchemaError` naming the key."""
    raw = (schema.metadata or {}).get(b"eaglenest.feature_meta")
    if raw is None:
        raise SchemaError("features table carries no eaglenest.feature_meta metadata")
    try:
        d = json.loads(raw.decode())
    except ValueError as exc:  # UnicodeDecodeError too
        raise SchemaError(f"features table: its eaglenest.feature_meta metadata is not JSON ({exc})") from None
    problem = _meta_problem(d)
    if problem:
        raise SchemaError(f"features table: eaglenest.feature_meta {problem}; the table was not written by "
                          "this eaglenest (capture it again, or import it with `featurestore import`)")
    return FeatureMeta.from_json(json.dumps(d))


#: The keys every stored FeatureMeta holds, and the kind of each value.
_META_KINDS = {"target": str, "layer_ids": list, "last_layer_id": int, "hidden_size": int, "dtype": str}


def _meta_problem(d) -> str | None:
    """What is wrong with a stored FeatureMeta object (None: nothing a reader would trip on)."""
    if not isinstance(d, dict):
        return f"is {short(d)}, not a JSON object"
    for key, kind in _META_KINDS.items():
        if key not in d:
            return f"lacks key '{key}'"
        v = d[key]
        if type(v) is not kind or (kind is list and not all(type(i) is int for i in v)):
            return f"key '{key}' is {short(v)}, expected {'a list of ints' if kind is list else kind.__name__}"
    if d["dtype"] not in _DTYPES:
        return f"key 'dtype' is {short(d['dtype'])}, expected one of {', '.join(_DTYPES)}"
    if d.get("storage", "raw") not in STORAGES:
        return f"key 'storage' is {short(d.get('storage'))}, expected one of {', '.join(STORAGES)}"
    if d["hidden_size"] < 1:
        return f"key 'hidden_size' is {d['hidden_size']}, expected >= 1"
    return None


def schema_version(schema: pa.Schema) -> int | None:
    raw = (schema.metadata or {}).get(b"eaglenest.schema_version", b"").decode()
    return int(raw) if raw.isascii() and raw.isdigit() else None  # '²' is a digit to isdigit, not to int


def tensor_layout(schema: pa.Schema) -> str:
    """``blob`` (schema version 2: Lance blob columns) or ``inline`` (version 1)."""
    md = schema.field("aux_hidden").metadata or {}
    return "blob" if md.get(b"lance-encoding:blob") == b"true" else "inline"


def validate(schema: pa.Schema, expected: pa.Schema, *, what: str) -> None:
    """Raise :class:`SchemaError` unless ``schema`` has every expected column with its type and a
    schema version this code reads."""
    version = schema_version(schema)
    is_prompts = (expected.metadata or {}).get(b"eaglenest.schema") == b"prompts"
    readable = (PROMPTS_SCHEMA_VERSION,) if is_prompts else READABLE_VERSIONS
    raw = (schema.metadata or {}).get(b"eaglenest.schema_version", b"").decode()
    if raw and version not in readable:
        raise SchemaError(f"{what}: schema version {raw}, this eaglenest reads "
                          f"{', '.join(map(str, readable))}; use an eaglenest that wrote it, or capture again")
    for field in expected:
        if field.name not in schema.names:
            raise SchemaError(f"{what}: missing column '{field.name}'")
        got = schema.field(field.name).type
        if got != field.type:
            raise SchemaError(f"{what}: column '{field.name}' is {got}, expected {field.type}")


def value_bytes(meta: FeatureMeta, num_tokens: np.ndarray, num_layers: int) -> np.ndarray:
    """Bytes of a stored tensor value of ``num_tokens`` tokens of ``num_layers`` layers, per row."""
    rows = num_tokens.astype(np.int64) * num_layers
    if meta.storage == "fp8_e4m3":
        return rows * (4 + meta.hidden_size)
    return rows * meta.hidden_size * _DTYPES[meta.dtype].itemsize


def row_problem(table: pa.Table, meta: FeatureMeta) -> str | None:
    """The first row of a features ``table`` whose sizes disagree (``num_tokens`` vs the lengths of
    ``input_ids`` and ``loss_mask`` and the bytes of the tensor values that ``meta`` implies), named by
    ``sample_id``; None when every row is consistent. A reader sizes each sample by these, so a row
    that breaks them would be stored and fail only when a training run reads it."""
    import pyarrow.compute as pc

    tokens = table.column("num_tokens").to_numpy().astype(np.int64)
    wants = {"input_ids": tokens, "loss_mask": tokens,
             "aux_hidden": value_bytes(meta, tokens, len(meta.layer_ids)), "last_hidden": value_bytes(meta, tokens, 1)}
    for col, want in wants.items():
        size = pc.list_value_length if col in ("input_ids", "loss_mask") else pc.binary_length
        got = size(table.column(col)).to_numpy()
        bad = np.nonzero(got != want)[0]
        if len(bad):
            k = int(bad[0])
            unit = "values" if size is pc.list_value_length else "bytes"
            more = f"; {len(bad)} rows like it" if len(bad) > 1 else ""
            return (f"row {short(table.column('sample_id')[k].as_py(), 60)}: {col} holds {got[k]} {unit}, "
                    f"not the {want[k]} of num_tokens {tokens[k]} ({len(meta.layer_ids)} aux layers, hidden "
                    f"{meta.hidden_size}, {meta.dtype} {meta.storage}{more})")
    return _mask_problem(table)


def _mask_problem(table: pa.Table) -> str | None:
    """The first row whose ``loss_mask`` holds a value other than 0 and 1 or whose ones are not
    ``num_loss_tokens`` (the trainer weights each token's loss by the mask and plans on the count)."""
    mask = table.column("loss_mask").combine_chunks()
    values = mask.values.to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = mask.offsets.to_numpy()
    ones = np.concatenate([[0], np.cumsum(values == 1)])
    counts = ones[offsets[1:]] - ones[offsets[:-1]]
    other = np.concatenate([[0], np.cumsum(values > 1)])
    rows = {"a value other than 0 and 1": np.nonzero(other[offsets[1:]] - other[offsets[:-1]])[0],
            "ones": np.nonzero(counts != table.column("num_loss_tokens").to_numpy())[0]}
    for what, bad in rows.items():
        if len(bad):
            k = int(bad[0])
            more = f"; {len(bad)} rows like it" if len(bad) > 1 else ""
            held = (f"{counts[k]} ones, not the num_loss_tokens {table.column('num_loss_tokens')[k].as_py()}"
                    if what == "ones" else what)
            return f"row {short(table.column('sample_id')[k].as_py(), 60)}: loss_mask holds {held}{more}"
    return None


def encode_tensor(array: np.ndarray, dtype: str) -> bytes:
    """Raw little-endian bytes of ``array`` (bf16 given as uint16 bit patterns or a torch view)."""
    want = _DTYPES[dtype]
    if array.dtype != want:
        raise SchemaError(f"tensor dtype {array.dtype} does not match the table dtype {dtype}")
    return np.ascontiguousarray(array).tobytes()


def decode_tensor(blob: bytes, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Inverse of :func:`encode_tensor` (bf16 comes back as uint16 bit patterns)."""
    arr = np.frombuffer(blob, dtype=_DTYPES[dtype])
    if arr.size != int(np.prod(shape)):
        raise SchemaError(f"tensor of {arr.size} elements cannot be shaped {shape}")
    return arr.reshape(shape)


def torch_from_blob(blob: bytes, shape: tuple[int, ...], dtype: str):
    """Decode a raw tensor value into a torch tensor of the stored dtype (a copy; see
    :mod:`eaglenest.featurestore.read.reader` for zero-copy views of Arrow buffers)."""
    import torch

    arr = decode_tensor(blob, shape, dtype)
    t = torch.from_numpy(arr.copy())
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def to_numpy(t) -> np.ndarray:
    """A numpy view of a CPU torch tensor (bfloat16 as its uint16 bit patterns), no copy."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def dtype_name(array: np.ndarray) -> str:
    """The table dtype name of a capture array (uint16 bit patterns are bfloat16)."""
    if array.dtype == np.uint16:
        return "bfloat16"
    return {"float32": "float32", "float16": "float16"}[str(array.dtype)]


# --- fp8_e4m3 storage ----------------------------------------------------------------------------
STORAGES = ("raw", "fp8_e4m3")
FP8_MAX = 448.0  # largest finite e4m3fn value


def _as_float32(array: np.ndarray, dtype: str):
    """A torch float32 tensor of a capture array (bf16 given as uint16 bit patterns)."""
    import torch

    want = _DTYPES[dtype]
    if array.dtype != want:
        raise SchemaError(f"tensor dtype {array.dtype} does not match the table dtype {dtype}")
    t = torch.from_numpy(np.ascontiguousarray(array))
    return (t.view(torch.bfloat16) if dtype == "bfloat16" else t).float()


def encode_fp8(array: np.ndarray, dtype: str) -> bytes:
    """``[..., H]`` -> per-row fp32 scales then e4m3 bytes (see the module docstring)."""
    import torch

    x = _as_float32(array, dtype)
    rows = x.reshape(-1, x.shape[-1])
    absmax = rows.abs().amax(dim=1) if rows.numel() else rows.new_zeros(rows.shape[0])
    # A zero row keeps scale 1 (its codes are all 0); inf/NaN rows give a non-finite scale (verify flags it).
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    # Clamp: x / scale can round a hair past 448, and e4m3fn has no inf (it would become NaN).
    q = (rows / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return scale.numpy().astype("<f4").tobytes() + q.view(torch.uint8).numpy().tobytes()


def fp8_parts(blob, rows: int, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """Views ``(scales [rows] float32, codes [rows, hidden] uint8)`` of an fp8 value (no copy)."""
    buf = np.frombuffer(blob, np.uint8)
    if buf.size != rows * (4 + hidden):
        raise SchemaError(f"fp8 value of {buf.size} bytes is not {rows} rows of {hidden} (+4 scale bytes)")
    return buf[:4 * rows].view("<f4"), buf[4 * rows:].reshape(rows, hidden)


def decode_fp8(blob, shape: tuple[int, ...]):
    """Inverse of :func:`encode_fp8`: a float32 torch tensor of ``shape`` (``shape[-1]`` = H)."""
    import torch

    rows = int(np.prod(shape[:-1]))
    scales, codes = fp8_parts(blob, rows, shape[-1])
    q = torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float()
    return (q * torch.from_numpy(scales.copy())[:, None]).reshape(shape)


def encode_value(array: np.ndarray, meta: "FeatureMeta") -> bytes:
    """The stored bytes of one tensor value under the table's storage mode."""
    if meta.storage == "raw":
        return encode_tensor(array, meta.dtype)
    if meta.storage == "fp8_e4m3":
        return encode_fp8(array, meta.dtype)
    raise SchemaError(f"unknown storage mode {meta.storage!r} (expected one of {STORAGES})")


def value_nonfinite(blob, meta: "FeatureMeta") -> bool:
    """Does a stored tensor value hold a NaN or inf (fp8: a non-finite scale or a NaN code)?"""
    if meta.storage == "fp8_e4m3":
        rows = len(blob) // (4 + meta.hidden_size)
        scales, codes = fp8_parts(blob, rows, meta.hidden_size)
        return bool(not np.isfinite(scales).all() or ((codes & 0x7F) == 0x7F).any())
    if meta.dtype == "bfloat16":
        return bool(((np.frombuffer(blob, "<u2") & 0x7F80) == 0x7F80).any())  # exponent all ones
    return bool(not np.isfinite(np.frombuffer(blob, _DTYPES[meta.dtype])).all())
