"""Capture overhead: regeneration plus hidden-state capture versus regeneration alone, same prompts.

    .venv/bin/python bench/ingest_capture.py [--prompts 256] [--rounds 3] [--max-tokens 160] [--one-pass] [--floor]

Two engines are started once and kept (start-up is not timed): the regeneration engine and the
capture engine (``extract_hidden_states`` + eaglenest's connector, as ``featurestore capture`` builds
it). Arms, order rotated every round, each into a fresh store:

* ``regen``: ``ingest.build.build`` (pool -> streamed regeneration -> prompts table).
* ``regen+capture``: the same, then ``featurestore.capture.build.capture`` over that store (prompt + response
  token ids through the capture engine, features table written), i.e. the pipeline's two passes.
* ``regen+prefill`` (``--floor``, a reference, not a pipeline path): regeneration, then the same
  prompt + response sequences through the *regeneration* engine with ``max_tokens=1`` (no capture
  method, no connector, nothing read or stored), its prefix cache emptied first (the capture engine
  has none of these sequences cached; the count of cached tokens is printed). It is the second forward
  pass alone, so its ratio is the floor for any two-pass capture on this machine.
* ``one-pass`` (``--one-pass``, an experiment, not a pipeline path): the capture engine generates
  the responses itself with ``kv_transfer_params.include_output_tokens`` and the hidden states of
  prompt + response (minus the last token) are read back from the same pass (checked, not stored:
  the features table wants every token's state, and the last response token never was an input).

Prints the per-round ratios to ``regen`` as median [min, max] (target for regen+capture: <= 1.25).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The set-up the ingest benches share (bench/ is not a package: loaded from the file beside this one).
_spec = importlib.util.spec_from_file_location("_bench_ingest_common", Path(__file__).with_name("ingest_common.py"))
C = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(C)


def main() -> None:
    ap = C.add_args(argparse.ArgumentParser())
    ap.add_argument("--one-pass", action="store_true", help="add the experiment: the capture engine generates too")
    ap.add_argument("--floor", action="store_true",
                    help="add the reference: regeneration + a max_tokens=1 prefill of the same sequences")
    a = ap.parse_args()

    from eaglenest.config import build as build_cfg
    from eaglenest.engine import EngineConfig, close_llm, make_llm
    from eaglenest.featurestore.capture import build as fbuild
    from eaglenest.featurestore.table import store
    from eaglenest.featurestore.capture.engine import Capturer, resolve_layer_ids
    from eaglenest.featurestore.config import FeaturestoreConfig
    from eaglenest.ingest.backends import LocalBackend
    from eaglenest.ingest.build import build
    from eaglenest.ingest.config import IngestConfig
    from eaglenest.ingest.pool import raw_text

    manifest, pool = C.load_prompts(a)
    engine = EngineConfig(max_model_len=1024, max_num_seqs=a.max_num_seqs, memory_fraction=0.08)
    icfg = build_cfg(IngestConfig, {})
    fcfg = build_cfg(FeaturestoreConfig, {"engine": {"max_model_len": 1024, "max_num_seqs": a.max_num_seqs,
                                                     "memory_fraction": 0.08}})
    facts = fbuild.target_facts(a.target)
    llm = make_llm(a.target, engine)
    backend = LocalBackend(llm)
    cap = Capturer(a.target, resolve_layer_ids([], facts["num_layers"]), facts["num_layers"], engine)
    # featurestore.capture builds its own Capturer; hand it the live one (kept open across rounds).
    fbuild.Capturer = lambda *args, **kw: contextlib.nullcontext(cap)
    scratch = Path(tempfile.mkdtemp(prefix="bench-ingest-capture-"))
    floor_cached: list[int] = []  # prompt tokens the floor's prefills found in the prefix cache, per run
    try:

        def regen(uri: str) -> int:
            stats = build(manifest, pool, target=a.target, store_uri=uri, cfg=icfg, backend=backend)
            assert stats["regenerated"] == len(pool), stats
            return stats["generated_tokens"]

        def regen_capture(uri: str) -> int:
            n = regen(uri)
            stats = fbuild.capture(target=a.target, store_uri=uri, cfg=fcfg)
            assert stats["captured"] == len(pool), stats
            return n

        def regen_prefill(uri: str) -> int:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            n = regen(uri)
            seqs = [c["prompt_token_ids"] + c["response_token_ids"] for c in fbuild.pool_conversations(uri)]
            # The regeneration just left these sequences' KV blocks in this engine's prefix cache: a prefill
            # reading them back would compute a fraction of the second pass. The capture engine has none of
            # them, so the floor starts from an empty cache too.
            llm.reset_prefix_cache()
            outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs],
                                SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
            assert len(outs) == len(pool)
            floor_cached.append(sum(o.num_cached_tokens or 0 for o in outs))
            return n

        def one_pass(uri: str) -> int:
            from vllm import SamplingParams
            from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
                cleanup_hidden_states, load_hidden_states)

            params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, seed=manifest.generation.seed,
                                    extra_args={"kv_transfer_params": {"include_output_tokens": True}})
            cap.llm.enqueue_chat([e.messages() for e in pool if e.mode == "chat"], params, use_tqdm=False)
            cap.llm.enqueue([raw_text(e) for e in pool if e.mode == "raw"], params, use_tqdm=False)
            n = 0
            for o in cap.llm.wait_for_completion(use_tqdm=False):  # one engine pass, chat and raw mixed
                path = o.kv_transfer_params["hidden_states_path"]
                data = load_hidden_states(path)
                cleanup_hidden_states(path)
                out = list(o.outputs[0].token_ids)
                assert data["token_ids"].tolist() == (list(o.prompt_token_ids) + out)[:-1]
                n += len(out)
            return n

        # Warm-up (and a check that one-pass generates what regeneration generates).
        regen_capture(str(scratch / "warm"))
        arms = {"regen": regen, "regen+capture": regen_capture, **({"regen+prefill": regen_prefill} if a.floor else {}),
                **({"one-pass": one_pass} if a.one_pass else {})}
        if a.one_pass:
            one_pass(str(scratch / "warm-one"))
        names = list(arms)
        secs: dict[str, list[float]] = {n: [] for n in names}
        toks: dict[str, set[int]] = {n: set() for n in names}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                llm.reset_prefix_cache()
                cap.llm.reset_prefix_cache()
                t0 = time.perf_counter()
                toks[name].add(arms[name](str(scratch / f"{name}-{r}")))
                secs[name].append(time.perf_counter() - t0)
            print(f"round {r} ({' -> '.join(order)}): " + "  ".join(f"{n} {secs[n][-1]:.2f} s" for n in names)
                  + f"  (load {os.getloadavg()[0]:.1f})", flush=True)
        rows = store.read(str(scratch / "warm"), "features", columns=["num_tokens"]).column("num_tokens").to_pylist()
    finally:  # also on Ctrl-C, SIGTERM (run_unwinding) or a failed round: no scratch stores left behind
        cap.close()
        close_llm(llm)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"prompts={len(pool)} max_tokens={a.max_tokens} max_num_seqs={a.max_num_seqs} rounds={a.rounds}; "
          f"generated tokens per arm: {toks}; captured tokens (prompt + response): {sum(rows)}")
    if a.floor:
        print(f"floor prefill: tokens read from the prefix cache per round {floor_cached} (0: all computed, "
              f"as in the capture engine)")
    for name in names[1:]:
        ratios = [x / b for x, b in zip(secs[name], secs["regen"])]
        print(f"{name} / regen (time) = {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]   "
              f"({name} {statistics.median(secs[name]):.2f} s, regen {statistics.median(secs['regen']):.2f} s)")


if __name__ == "__main__":
    sys.exit(C.run_unwinding(main))
