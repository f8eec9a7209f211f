"""The feature-store contract: Arrow schemas declared once, versioned, validated on read and write.

Two tables live in a store (a LanceDB directory):

* ``prompts``: the prompt pool and its on-policy responses (written by ``ingest``).
* ``features``: one row per sample with token ids, the assistant loss mask and the target's hidden
  states (written by ``featurestore capture``).

Hidden states are stored as raw little-endian bytes of the target's own dtype (bf16, fp16 or fp32)
in ``large_binary`` columns, so any dtype round-trips bit-exactly and a row costs no conversion on
read: ``aux_hidden`` is ``[num_tokens, num_aux_layers, hidden_size]`` and ``last_hidden`` is
``[num_tokens, hidden_size]``. Shape and dtype are table-level metadata (``FeatureMeta``), so the
per-row overhead is one length. Layer ids are in vLLM's convention (id 0 = embedding output,
id L = output of the last block before the final norm).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa

from eaglenest.errors import SchemaError

SCHEMA_VERSION = 1

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
], metadata={"eaglenest.schema": "prompts", "eaglenest.schema_version": str(SCHEMA_VERSION)})

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
    pa.field("aux_hidden", pa.large_binary(), nullable=False),
    pa.field("last_hidden", pa.large_binary(), nullable=False),
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
    #: JSON of the identity components hashed into ``feature_set_id`` (see featurestore/identity.py).
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
    raw = (schema.metadata or {}).get(b"eaglenest.feature_meta")
    if raw is None:
        raise SchemaError("features table carries no eaglenest.feature_meta metadata")
    return FeatureMeta.from_json(raw.decode())


def validate(schema: pa.Schema, expected: pa.Schema, *, what: str) -> None:
    """Raise :class:`SchemaError` unless ``schema`` has every expected column with its type."""
    version = (schema.metadata or {}).get(b"eaglenest.schema_version", b"").decode()
    if version and version != str(SCHEMA_VERSION):
        raise SchemaError(f"{what}: schema version {version}, this eaglenest reads {SCHEMA_VERSION}")
    for field in expected:
        if field.name not in schema.names:
            raise SchemaError(f"{what}: missing column '{field.name}'")
        got = schema.field(field.name).type
        if got != field.type:
            raise SchemaError(f"{what}: column '{field.name}' is {got}, expected {field.type}")


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
    """Decode a tensor column straight into a torch tensor of the stored dtype."""
    import torch

    arr = decode_tensor(blob, shape, dtype)
    t = torch.from_numpy(arr.copy())
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t
