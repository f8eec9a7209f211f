"""vLLM KV connector that hands captured hidden states to the feature store, on CPU and CUDA.

vLLM's ``extract_hidden_states`` speculative method caches the target's hidden states at the
requested layers in a KV-cache-like buffer; a KV connector copies them out when a request finishes.
vLLM's own ``ExampleHiddenStatesConnector`` does that copy with CUDA streams and pinned memory, so on
a CPU engine it dies at the first save. This subclass keeps vLLM's scheduler-side bookkeeping (lock
files, delayed block freeing) and replaces only the copy:

* CUDA: unchanged (vLLM's async device-to-host copy).
* CPU: a plain gather out of the buffer, then the same background safetensors write.

Every file is written under a temporary name and renamed, so a reader never sees half a file.

Publish mode (the streaming bypass, :mod:`eaglenest.featurestore.stream`): when eaglenest sets
``kv_connector_extra_config.eaglenest_publish_socket``, captures are not written at all; each one is
sent to that socket (blocking until the consumer grants a credit, which is the backpressure), tagged
with the request's ``kv_transfer_params.eaglenest_tag``. Like the spool directory, the socket is
engine configuration, never something an API client can choose.
The spool directory is set by eaglenest (``kv_connector_extra_config.shared_storage_path``); a
client-chosen path (``allow_custom_save_path``) is refused, because it would let an API client write
anywhere on the server.

Loaded by vLLM with ``kv_connector_module_path="eaglenest.featurestore.connector"``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from functools import partial

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

log = logging.getLogger(__name__)

CONNECTOR_NAME = "EaglenestHiddenStatesConnector"
MODULE_PATH = __name__


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


class EaglenestHiddenStatesConnector(ExampleHiddenStatesConnector):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.allow_custom_save_path:
            log.warning("allow_custom_save_path is ignored: eaglenest chooses where captures go")
        self.allow_custom_save_path = False
        from eaglenest.featurestore import stream

        path = self._kv_transfer_config.get_from_extra_config(stream.PUBLISH_KEY, None)
        self._tag_key = stream.TAG_KEY
        #: Publish mode: captures go to the consumer's socket, no files and no lock files.
        self._publisher = stream.Publisher(str(path)) if path else None
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

        # clone: the buffer slots are reused as soon as the scheduler frees the blocks.
        hidden = self._gather(pending).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}

        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        future = self._executor.submit(_write_atomic, tensors, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))

    def _gather(self, pending: PendingSave) -> torch.Tensor:
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()
        return extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])

    def _publish(self, pending: PendingSave) -> None:
        # Synchronous on purpose: the send waits for a credit, so a slow consumer stalls the engine
        # step instead of piling captures up in memory. .cpu()/.clone() copy out of the buffer,
        # whose slots are reused as soon as the scheduler frees the blocks.
        hidden = self._gather(pending)
        hidden = hidden.cpu() if hidden.is_cuda else hidden.clone()
        self._publisher.publish(getattr(pending, "tag", None), pending.token_ids, hidden)
        self._req_copy_events[pending.req_id] = _Done()
