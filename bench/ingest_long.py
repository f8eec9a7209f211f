"""Capture cost on long samples: capture time / regeneration time for composed long conversations.

    .venv/bin/python bench/ingest_long.py [--lengths 2048 8192] [--per-length 1] [--rounds 1]

For each target length, a fresh store gets ``--per-length`` ``long_chat`` conversations
(``ingest/compose.py``; recipes/manifests/long.yaml's sources), regenerated on-policy turn by turn.
Engines are started once and kept (start-up is not timed). Arms, side by side in one run:

* ``regen``: ``ingest.build.build`` through the regeneration engine (vLLM prefix caching on, as
  ``ingest build`` runs it: each turn's history is a cache hit).
* ``capture``: ``featurestore.capture.build.capture`` over that store through the capture engine
  (``extract_hidden_states`` + eaglenest's connector): the pipeline's second pass, one prefill of
  the whole conversation.
* ``recapture`` (reference): the same sequences through the same capture engine again, prefix
  cache warm: what capture costs when its prefill is already in the cache (the hidden-state slots
  are cached with the KV blocks); checked bit-identical to ``capture``'s tensors.

Prints per length: capture / regen, (regen + capture) / regen, recapture / capture, the bytes
stored per token and the captured sizes. Every store lives in a temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from eaglenest.cli import at_least

# What the benches share: here, run_unwinding (bench/ is not a package: loaded from the file beside this one).
_spec = importlib.util.spec_from_file_location("_bench_arms", Path(__file__).with_name("arms.py"))
arms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The manifest's compose.target_tokens floor: the Compose built below skips the manifest's validation.
    ap.add_argument("--lengths", type=at_least(256), nargs="+", default=[2048, 8192],
                    help="target lengths in tokens of the composed conversations (each >= 256)")
    ap.add_argument("--per-length", type=at_least(1), default=1, help="conversations per length")
    ap.add_argument("--rounds", type=at_least(1), default=1, help="rounds (arms alternated; median [min, max])")
    ap.add_argument("--target", default="assets/tiny-target", help="the target model folder")
    ap.add_argument("--manifest", default="recipes/manifests/long.yaml", help="the manifest of the long_chat sources")
    a = ap.parse_args()

    import numpy as np

    from eaglenest.config import build as build_cfg
    from eaglenest.engine import EngineConfig, close_llm, make_llm
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.capture import build as fbuild
    from eaglenest.featurestore.capture.engine import Capturer, resolve_layer_ids
    from eaglenest.featurestore.config import FeaturestoreConfig
    from eaglenest.featurestore.table import store
    from eaglenest.ingest.backends import LocalBackend
    from eaglenest.ingest.build import build
    from eaglenest.ingest.config import IngestConfig
    from eaglenest.ingest.manifest import Compose, load_manifest
    from eaglenest.ingest.pool import load_pool

    base = load_manifest(a.manifest)
    name = next(n for n, d in base.domains.items() if d.compose is not None)
    max_len = max(a.lengths) + 2 * base.generation.max_tokens + 64
    engine = EngineConfig(max_model_len=max_len, max_num_seqs=8, memory_fraction=0.08)
    fcfg = build_cfg(FeaturestoreConfig, {"engine": {"max_model_len": max_len, "max_num_seqs": 8,
                                                     "memory_fraction": 0.08}})
    facts = fbuild.target_facts(a.target)
    llm = make_llm(a.target, engine)
    backend = LocalBackend(llm)
    cap = Capturer(a.target, resolve_layer_ids([], facts["num_layers"]), facts["num_layers"], engine)
    fbuild.Capturer = lambda *args, **kw: contextlib.nullcontext(cap)  # the live engine, kept across arms
    scratch = Path(tempfile.mkdtemp(prefix="bench-ingest-long-"))
    try:
        for length in a.lengths:
            d = base.domains[name]
            comp = Compose(rule="long_chat", target_tokens=[length], per_length=a.per_length,
                           answer_tokens=d.compose.answer_tokens)
            manifest = dataclasses.replace(base, domains={name: dataclasses.replace(d, compose=comp,
                                                                                     cap_prompts=a.per_length)})
            pool = [e for e in load_pool(manifest, target=a.target) if e.split == "train"]
            for r in range(a.rounds):
                uri = str(scratch / f"{length}-{r}")
                llm.reset_prefix_cache()
                cap.llm.reset_prefix_cache()
                t0 = time.perf_counter()
                st = build(manifest, pool, target=a.target, store_uri=uri, cfg=build_cfg(IngestConfig, {}),
                           backend=backend)
                t_regen = time.perf_counter() - t0
                assert st["regenerated"] == len(pool), st
                t0 = time.perf_counter()
                cs = fbuild.capture(target=a.target, store_uri=uri, cfg=fcfg)
                t_cap = time.perf_counter() - t0
                convs = fbuild.pool_conversations(uri)
                seqs = [c["prompt_token_ids"] + c["response_token_ids"] for c in convs]
                t0 = time.perf_counter()
                again = cap.capture(seqs)
                t_re = time.perf_counter() - t0
                feats = store.read(uri, "features", columns=["sample_id", "aux_hidden", "num_tokens"]).to_pylist()
                meta = S.feature_meta(store.dataset(uri, "features").schema)
                by_id = {f["sample_id"]: f for f in feats}
                same = all(S.encode_value(aux, meta) == by_id[c["sample_id"]]["aux_hidden"]
                           for c, (aux, _) in zip(convs, again))
                diff = max(float(np.abs(S.decode_tensor(by_id[c["sample_id"]]["aux_hidden"], aux.shape, meta.dtype)
                                        .astype(np.float64) - aux.astype(np.float64)).max())
                           for c, (aux, _) in zip(convs, again)) if meta.storage == "raw" else float("nan")
                tokens = sum(f["num_tokens"] for f in feats)
                turns = [len([m for m in json.loads(c["messages_json"]) if m["role"] == "assistant"])
                         for c in convs]
                print(f"length {length} round {r}: {len(convs)} conversation(s), {tokens} tokens "
                      f"({[f['num_tokens'] for f in feats]}), assistant turns {turns}, "
                      f"{st['generated_tokens']} tokens generated (last turns)  load {os.getloadavg()[0]:.1f}")
                print(f"  regen {t_regen:.2f} s  capture {t_cap:.2f} s  recapture (prefix cache warm) {t_re:.2f} s")
                print(f"  capture / regen = {t_cap / t_regen:.3f}   (regen + capture) / regen = "
                      f"{(t_regen + t_cap) / t_regen:.3f}   recapture / capture = {t_re / t_cap:.3f} "
                      f"(tensors bit-identical: {same}, max abs difference {diff:.2e})")
                print(f"  bytes per token {cs['bytes_per_token']} (hidden states, {meta.dtype}, "
                      f"{len(meta.layer_ids)} aux + last layer of H={meta.hidden_size}); captured "
                      f"{cs['captured_hidden_bytes'] / 2**20:.1f} MiB for {cs['captured_tokens']} tokens", flush=True)
    finally:
        cap.close()
        close_llm(llm)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(arms.run_unwinding(main))
