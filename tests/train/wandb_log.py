"""The records of a W&B offline run file (``run-*.wandb``), read with wandb's own record schema.

The file is ``:W&B`` + magic + version (7 bytes), then LevelDB-log records in 32 KiB blocks (crc32c 4,
length 2, type 1: full / first / middle / last) holding ``wandb_internal_pb2.Record``s."""

from __future__ import annotations

import struct
from pathlib import Path


def records(run_file: Path):
    """Each ``wandb_internal_pb2.Record`` of ``run_file``, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):  # a full record, or the last part of one
            yield pb.Record.FromString(parts)
