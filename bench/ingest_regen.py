"""Regeneration through eaglenest versus a bare ``vllm.LLM.generate`` over the same prompts, one engine.

    .venv/bin/python bench/ingest_regen.py [--prompts 256] [--rounds 3] [--max-tokens 160]
                                           [--ignore-eos] [--legacy] [--commit-every 64]

Arms, timed side by side on ONE engine (same settings), order rotated every round, prefix cache
reset before each arm:

* ``bare``: one ``LLM.generate`` call over the exact prompt token ids eaglenest sends (its chat
  prompts rendered by vLLM's template, its raw prompts tokenised): the engine's best case.
* ``eaglenest``: the whole ``ingest.build.build`` into a fresh store: pool entries (chat and raw mixed
  as the manifest says) streamed through ``LocalBackend``, rows written as Lance fragments and one
  commit per ``commit_every`` shard, stats read back.
* ``legacy`` (``--legacy``): what build did before streaming: per shard, ``complete`` (raw) then
  ``chat`` (chat) as two batch calls, then write and commit before the next shard starts.

Greedy decoding, so every arm generates the same tokens; throughput = generated tokens / wall time.
Prints per-round tokens/s and the ratio to ``bare`` as median [min, max] (target: eaglenest >= 0.9).
On a shared machine wall time is noisy, so each arm's CPU time (this process plus the engine's
processes) is reported too: the ratio of CPU seconds per arm says how much more work an arm does,
whatever the neighbours were doing.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from eaglenest.cli import at_least

# The set-up the ingest benches share (bench/ is not a package: loaded from the file beside this one).
_spec = importlib.util.spec_from_file_location("_bench_ingest_common", Path(__file__).with_name("ingest_common.py"))
C = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(C)


def main() -> None:
    ap = C.add_args(argparse.ArgumentParser())
    ap.add_argument("--ignore-eos", action="store_true", help="every answer runs to --max-tokens")
    ap.add_argument("--legacy", action="store_true", help="also time the pre-streaming per-shard path")
    ap.add_argument("--commit-every", type=at_least(1), default=64, help="prompts per shard commit")
    a = ap.parse_args()

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eaglenest.config import build as build_cfg
    from eaglenest.engine import EngineConfig, close_llm, make_llm
    from eaglenest.ingest.backends import LocalBackend
    from eaglenest.ingest.build import build, commit
    from eaglenest.ingest.config import IngestConfig
    from eaglenest.ingest.pool import raw_text
    from eaglenest.ingest.regen import row
    from eaglenest.ingest.shard import write_rows

    manifest, pool = C.load_prompts(a)
    cfg = build_cfg(IngestConfig, {"commit_every": a.commit_every})

    class Backend(LocalBackend):
        def _params(self, gen):
            return SamplingParams(temperature=gen.temperature, max_tokens=gen.max_tokens, seed=gen.seed,
                                  ignore_eos=a.ignore_eos)

    llm = make_llm(a.target, EngineConfig(max_model_len=1024, max_num_seqs=a.max_num_seqs))
    backend = Backend(llm)
    params = backend._params(manifest.generation)
    scratch = Path(tempfile.mkdtemp(prefix="bench-ingest-regen-"))
    try:

        def run_eaglenest(r: int) -> int:
            stats = build(manifest, pool, target=a.target, store_uri=str(scratch / f"e{r}"), cfg=cfg, backend=backend)
            assert stats["regenerated"] == len(pool) and stats["failed"] == 0, stats
            return stats["generated_tokens"]

        # Warm-up, and the exact prompt ids eaglenest sends (bare generates from the same ids).
        from eaglenest.featurestore.table import store
        run_eaglenest(-1)
        by_id = {x["sample_id"]: x for x in store.read(str(scratch / "e-1"), store.PROMPTS).to_pylist()}
        token_prompts = [TokensPrompt(prompt_token_ids=by_id[e.sample_id]["prompt_token_ids"]) for e in pool]

        def run_bare(r: int) -> int:
            return sum(len(o.outputs[0].token_ids) for o in llm.generate(token_prompts, params, use_tqdm=False))

        def run_legacy(r: int) -> int:
            uri, n = str(scratch / f"l{r}"), 0
            for k in range(0, len(pool), a.commit_every):
                shard = pool[k:k + a.commit_every]
                raw = [e for e in shard if e.mode == "raw"]
                chat = [e for e in shard if e.mode == "chat"]
                outs = list(zip(raw, backend.complete([raw_text(e) for e in raw], manifest.generation)))
                outs += zip(chat, backend.chat([e.messages() for e in chat], manifest.generation))
                rows = [row(e, messages=[], prompt_ids=c.prompt_ids, response_ids=c.response_ids,
                            finish_reason=c.finish_reason, gen_id="bench") for e, c in outs]
                commit(uri, write_rows(uri, rows), {"shard": k})
                n += sum(len(x["response_token_ids"]) for x in rows)
            return n

        import psutil

        me = psutil.Process()

        def cpu_s() -> float:  # this process and the engine's (engine core, worker)
            return sum(sum(p.cpu_times()[:2]) for p in [me, *me.children(recursive=True)])

        arms = {"bare": run_bare, "eaglenest": run_eaglenest, **({"legacy": run_legacy} if a.legacy else {})}
        names = list(arms)
        tps: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[float]] = {n: [] for n in names}
        toks: dict[str, set[int]] = {n: set() for n in names}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                llm.reset_prefix_cache()
                c0, t0 = cpu_s(), time.perf_counter()
                n = arms[name](r)
                tps[name].append(n / (time.perf_counter() - t0))
                cpu[name].append(cpu_s() - c0)
                toks[name].add(n)
            print(f"round {r} ({' -> '.join(order)}): " + "  ".join(f"{n} {tps[n][-1]:.0f} tok/s" for n in names),
                  flush=True)
    finally:  # also on Ctrl-C, SIGTERM (run_unwinding) or a failed round: no scratch stores left behind
        close_llm(llm)
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"prompts={len(pool)} (raw {sum(e.mode == 'raw' for e in pool)}) max_tokens={a.max_tokens} "
          f"ignore_eos={a.ignore_eos} commit_every={a.commit_every} max_num_seqs={a.max_num_seqs} "
          f"rounds={a.rounds}; generated tokens per arm: {toks}")
    for name in names[1:]:
        ratios = [x / b for x, b in zip(tps[name], tps["bare"])]
        print(f"{name}/bare = {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]   "
              f"({name} {statistics.median(tps[name]):.0f} tok/s, bare {statistics.median(tps['bare']):.0f} tok/s)")
        c = [x / b for x, b in zip(cpu[name], cpu["bare"])]
        print(f"  CPU seconds {name}/bare = {statistics.median(c):.3f} [{min(c):.3f}, {max(c):.3f}]   "
              f"({name} {statistics.median(cpu[name]):.2f} s, bare {statistics.median(cpu['bare']):.2f} s)")


if __name__ == "__main__":
    sys.exit(C.run_unwinding(main))
