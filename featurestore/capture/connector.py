"""vLLM KV connector that hands captured hidden states to the feature store, on CPU and CUDA.

vLLM's ``extract_hidden_states`` speculative method caches the target's hidden states at the
requested layers in a KV-cache-like buffer; a KV connector copies them out when a request finishes.
vLLM's own ``ExampleHiddenStatesConnector`` does that copy with CUDA streams and pinned memory, so on
a CPU engine it dies at the first save. This subclass keeps vLLM's scheduler-side bookkeeping (lock
files, delayed block freeing) and replaces only the copy:

* CUDA: unchanged (vLLM's async device-to-host copy).
* CPU: one gather out of the buffer with numpy (a single copy of exactly the request's token slots;
  no clone), then the same background safetensors write. Not torch indexing: on a CPU engine every
  small torch op runs on the worker's OpenMP team, and vLLM's advanced-indexing gather plus a clone
  cost ~1 ms per request on 2 cores (8 ms when the cores were shared), against ~0.02 ms for numpy's
  single-threaded copy of the same bytes (a 71-token, 4-layer, H=128 request; bit-identical, tested).

Every file is written under a temporary name and renamed, so a reader never sees half a file.

Publish mode (the streaming bypass, :mod:`eaglenest.featurestore.stream.local`; the frames are
:mod:`eaglenest.featurestore.capture.publish`'s): when eaglenest sets
``kv_connector_extra_config.eaglenest_publish_socket``, captures are not written at all; each one is
sent to that socket (blocking until the consumer grants a credit, which is the backpressure), tagged
with the request's ``kv_transfer_params.eaglenest_tag``; a request without a tag is not sent (the
producer's flush). Like the spool directory, the socket is engine configuration, never something an
API client can choose.
The spool directory is set by eaglenest (``kv_connector_extra_config.shared_storage_path``); a
client-chosen path (``allow_custom_save_path``) is refused, because it would let an API client write
anywhere on the server.

Loaded by vLLM with ``kv_connector_module_path="eaglenest.featurestore.capture.connector"``
(:data:`eaglenest.featurestore.capture.engine.CONNECTOR_MODULE`, which must stay this module's name).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from functools import partial

import numpy as np
import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from eaglenest.featurestore.capture import publish

log = logging.getLogger(__name__)



class _Done:
    """Stands in for a CUDA event on CPU: the copy is synchronous, so it is always complete."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


@dataclasses.dataclass
class TaggedSave(PendingSave):
    """A pending save that also carries the request's stream tag (publish mode)."""

    tag: int | None = None


def _write_atomic(tensors: dict[str, torch.Tensor], filename: str, lock_fd: int | None) -> None:
    try:
        tmp = f"{filename}.tmp"
        save_file(tensors, tmp)
        os.replace(tmp, filename)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # releases the writer's LOCK_EX: readers wake up


def gather_cpu(kv_cache: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens`` slots of ``block_ids`` out of a CPU hidden-states buffer viewed as
    ``[num_blocks, num_layers, block_size, hidden]``, as a new ``[num_tokens, num_layers, hidden]``
    tensor: the same values as vLLM's ``extract_from_kv_cache`` (token ``t`` is slot ``t % block_size``
    of block ``block_ids[t // block_size]``), bit for bit, in one single-threaded numpy copy. Works
    on the raw bits (a same-size integer view), so bfloat16, which numpy lacks, is copied exactly."""
    block_size = kv_cache.shape[2]
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[kv_cache.element_size()]
    buf = kv_cache.view(bits).numpy()  # a view: no copy
    slots = np.arange(num_tokens)
    blocks = np.asarray(block_ids, dtype=np.int64)[slots // block_size]
    # Advanced indices around a slice: numpy puts the token axis first -> [num_tokens, layers, hidden].
    out = buf[blocks, :, slots % block_size]
    return torch.from_numpy(out).view(kv_cache.dtype)


class EaglenestHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.allow_custom_save_path:
            log.warning("allow_custom_save_path is ignored: eaglenest chooses where captures go")
        self.allow_custom_save_path = False
        path = self._kv_transfer_config.get_from_extra_config(publish.PUBLISH_KEY, None)
        self._tag_key = publish.TAG_KEY
        #: Publish mode: captures go to the consumer's socket, no files and no lock files.
        self._publisher = publish.Publisher(str(path)) if path else None
        if self._publisher is not None:
            self.use_lock = False

    def request_finished(self, request, block_ids):
        delay, params = super().request_finished(request, block_ids)
        pending = self._pending_saves.get(request.request_id)
        if pending is not None:
            tag = (request.kv_transfer_params or {}).get(self._tag_key)
            self._pending_saves[request.request_id] = TaggedSave(**vars(pending), tag=tag)
        return delay, params

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._publisher is not None:
            return self._publish(pending)
        if self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)

        # _gather copies: the buffer slots are reused as soon as the scheduler frees the blocks.
        tensors = {"hidden_states": self._gather(pending), "token_ids": pending.token_ids.clone()}

        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        future = self._executor.submit(_write_atomic, tensors, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def _gather(self, pending: PendingSave) -> torch.Tensor:
        """``[num_tokens, num_layers, hidden]`` of the request, copied out of the buffer (CPU: a
        fresh tensor; CUDA: a device tensor the caller copies to the host)."""
        num_tokens = pending.token_ids.shape[0]
        if self._kv_cache.is_cuda:
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
            return extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens)
        return gather_cpu(self._kv_cache, pending.block_ids, num_tokens)

    def _publish(self, pending: PendingSave) -> None:
        # Synchronous on purpose: the send waits for a credit, so a slow consumer stalls the engine
        # step instead of piling captures up in memory. _gather (CPU) / .cpu() (CUDA) copy out of
        # the buffer, whose slots are reused as soon as the scheduler frees the blocks.
        self._req_copy_events[pending.req_id] = _Done()
        tag = getattr(pending, "tag", None)
        if tag is None:  # not a stream item (the producer's flush request): nothing to send
            return
        hidden = self._gather(pending)
        hidden = hidden.cpu() if hidden.is_cuda else hidden
        self._publisher.publish(tag, pending.token_ids, hidden)
