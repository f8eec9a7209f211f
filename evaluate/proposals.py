"""Record the draft tokens a vLLM engine proposes, round by round, from inside its worker.

vLLM loads this class into each worker as its ``worker_extension_cls`` (a qualified name, so the
worker process imports it; nothing is pickled), and the parity check calls its methods by name
through ``LLM.collective_rpc``. :meth:`ProposalRecorder.start_recording_proposals` wraps the model
runner's drafter ``propose`` (the call that turns a verified batch into the next draft tokens, for
every family vLLM serves: EAGLE-3 chains, parallel drafting, DFlash blocks) so each call's output
ids are kept with the request id of each row; :meth:`ProposalRecorder.recorded_proposals` returns
them. The trade-off: the wrapper reads the runner's ``input_batch.req_ids`` for the row order, a
vLLM internal that the parity tests pin (a changed order would show as parity failing everywhere).
"""

from __future__ import annotations


class ProposalRecorder:
    """Mixed into vLLM's worker (``worker_extension_cls``); ``self`` is the worker."""

    def start_recording_proposals(self) -> None:
        """Wrap the drafter's ``propose`` once; later calls clear what was recorded."""
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        if drafter is None:
            raise RuntimeError("the engine has no drafter: start it with a speculative_config")
        records = getattr(drafter, "_eaglenest_proposals", None)
        if records is not None:
            records.clear()
            return
        records = []
        original = drafter.propose

        def propose(*args, **kwargs):
            out = original(*args, **kwargs)
            ids = out[0] if isinstance(out, tuple) else out  # some paths return (ids, valid counts)
            rows = ids.cpu().tolist()
            records.append((list(runner.input_batch.req_ids)[: len(rows)], rows))
            return out

        drafter.propose = propose
        drafter._eaglenest_proposals = records

    def recorded_proposals(self) -> list[tuple[list[str], list[list[int]]]]:
        """Every recorded call in order: (request ids of the rows, draft token ids per row)."""
        return list(getattr(self.model_runner.drafter, "_eaglenest_proposals", None) or [])
