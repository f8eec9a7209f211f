"""The engine side of the capture stream: frames of hidden states sent to the consumer's socket.

The capture connector's publish mode (:mod:`eaglenest.featurestore.capture.connector`) hands each
finished request's ``[T, layers, H]`` tensor and token ids to a :class:`Publisher`, which sends them
as one frame (a small JSON header, then raw bytes; no pickles) over a Unix-domain socket owned by
the consumer (:mod:`eaglenest.featurestore.stream.local`), one credit each: without a credit it
blocks the engine's step, which is the stream's backpressure. The frame format and the two
configuration keys live here, below both the connector and the consumer, so the engine side needs
nothing from the streaming package.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import time

import numpy as np

from eaglenest.featurestore import schema as S

log = logging.getLogger(__name__)

#: kv_connector_extra_config key that switches the connector to publish mode (set by eaglenest only).
PUBLISH_KEY = "eaglenest_publish_socket"
#: kv_transfer_params key carrying a request's position in the stream.
TAG_KEY = "eaglenest_tag"

#: One frame: magic, header bytes, payload bytes; then the JSON header, then the payload.
FRAME = struct.Struct("<4sIQ")
MAGIC = b"ENS1"
#: One byte per credit, consumer to publisher.
CREDIT = b"\x01"


class Publisher:
    """Engine side: sends captures to the consumer's socket, one credit each (blocks without one)."""

    def __init__(self, path: str):
        self.path = path
        self._sock: socket.socket | None = None
        self._credits = 0
        self._seq = 0
        self.gone = False

    def publish(self, tag, token_ids, hidden) -> None:
        """Send one capture (``hidden``: a CPU torch tensor ``[T, layers, H]``)."""
        if self.gone:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._sock.connect(self.path)
            while self._credits == 0:  # backpressure: the engine's step waits here
                got = self._sock.recv(4096)
                if not got:
                    raise ConnectionError("consumer closed the stream")
                self._credits += len(got)
            self._credits -= 1
            raw = S.to_numpy(hidden)
            ids = np.ascontiguousarray(token_ids.numpy().astype(np.int64))
            header = json.dumps({"tag": tag, "seq": self._seq, "shape": list(raw.shape), "dtype": S.dtype_name(raw),
                                 "sent_at": time.time()}).encode()
            body = [memoryview(ids).cast("B"), memoryview(raw).cast("B")]
            size = sum(b.nbytes for b in body)
            self._sock.sendall(FRAME.pack(MAGIC, len(header), size) + header, socket.MSG_NOSIGNAL)
            for b in body:
                self._sock.sendall(b, socket.MSG_NOSIGNAL)
            self._seq += 1
        except OSError as exc:  # the consumer is gone: drop captures; the producer stops the engine
            self.gone = True
            log.warning("capture stream %s closed (%s): dropping further captures", self.path, exc)
