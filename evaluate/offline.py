"""Offline acceptance length: Hugging Face target + PyTorch draft, greedy verification, no vLLM.

For quick in-loop use (during training, in notebooks) where starting a vLLM engine is too slow or
impossible. It replays vLLM's EAGLE-3 proposer (``vllm/v1/spec_decode``) step for step:

* The target decodes greedily with a Hugging Face KV cache; after each forward the aux hidden
  states (``output_hidden_states[j]`` for the draft's vLLM layer ids ``j``, ascending) of the
  accepted positions are kept, combined by the draft's ``fc``.
* Each round, with verified tokens ``s_0 .. s_{n-1}`` (target features known for ``0 .. n-2``),
  draft step 0 runs causally over positions ``i = 0 .. n-2`` with input token ``s_{i+1}`` and the
  target feature of ``i`` (vLLM's shifted inputs); its last position proposes ``d_1``. Steps
  ``j = 1 .. k-1`` feed ``d_j`` and the draft's own hidden output at position ``n-2+j``,
  attending to the step-0 keys plus the chain's earlier steps (as vLLM's draft KV cache holds
  them). Draft argmax ids map to target ids through ``d2t``.
* The target scores ``[s_{n-1}, d_1 .. d_k]`` in one forward; the longest prefix of drafts that
  equals the target's argmax is accepted, plus one target token. The target cache is cropped to the
  accepted length. Counting follows vLLM's scheduler: every verification round counts, including
  accepted tokens that are later cut by ``max_tokens`` or a stop token.

A DFlash draft (``train.family=dflash``, its train checkpoint or its export) replays vLLM's DFlash proposer
instead: each round one forward of the block [s_{n-1}, mask x k] over the context states of
``0 .. n-2`` (:func:`eaglenest.train.dflash.propose`). A P-EAGLE draft (``train.family=peagle``,
``parallel_drafting``) replays vLLM's parallel drafting: each round one forward of step 0 over
``0 .. n-2`` plus ``k - 1`` mask slots after it (:func:`eaglenest.train.peagle.propose`).

Trade-offs: one request at a time (no batching), and the draft's step 0 is recomputed over the whole
sequence each round (exact and simple; quadratic in length, fine for chat-sized prompts, slow for
long-context buckets). The draft runs in the target's dtype; with an fp32 target and draft the
result matches vLLM's served figures exactly unless a near-tie argmax flips between kernels.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from eaglenest.errors import ConfigError
from eaglenest.evaluate.al import per_request_summary
from eaglenest.evaluate.prompts import mode_of, prompt_tokens
from eaglenest.hf import load_causal_lm, load_tokenizer
from eaglenest.paths import read_json_object, shown_path
from eaglenest.serve import formats, fp8
from eaglenest.specdecode import SpecCounters
from eaglenest.target import pinned_revision
from eaglenest.train import dflash, peagle
from eaglenest.train.checkpoint import INFO, WEIGHTS, load_checkpoint
from eaglenest.train.model import Eagle3Draft, chunk_doc_mask
from eaglenest.train.target import load_target_tensors, target_config

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RequestAL:
    """One request: its output ids (as vLLM returns them) and accepted-count histogram per round."""

    sample_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    histogram: list[int]  # histogram[j] = rounds in which exactly j draft tokens were accepted


def load_draft(draft: str | Path, target_dir: str | Path, *, key: str = "evaluate.draft",
               target_keys: dict[str, str] | None = None):
    """An :class:`Eagle3Draft` (or a DFlash draft) from an exported draft dir (vLLM's format, or
    speculators' Eagle-3 / P-EAGLE / DFlash layout) or a ``train`` checkpoint dir (any family); errors name ``key`` (where the caller
    got ``draft`` from: a recipe key or a flag), and a target the draft does not fit names run.target.
    The target's embeddings are read where the checkpoint records training found them, or for an export
    (which records none) where ``target_keys`` (``run.target_keys``; None or empty names: the rule) says."""
    path = Path(draft)
    if (path / INFO).is_file():
        model, info = _checkpoint_draft(path, key)
        _check_mask_token(model, path / INFO, key, "the checkpoint is damaged: train again (`train run`)")
        return _with_embeddings(model, target_dir, target_keys=info.get("target_keys") or target_keys).eval()
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise ConfigError(f"{key}: {draft} is neither an exported draft (config.json + "
                          f"model.safetensors) nor a draft checkpoint ({INFO})")
    redo = "export the draft again (`serve export`)"
    try:
        raw = read_json_object(path / "config.json", error=ConfigError, then=redo)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {exc}") from None
    speculators = raw.get("speculators_model_type")
    dflash_export = isinstance(raw.get("dflash_config"), dict) or speculators == "dflash"
    if dflash_export:  # its own model (train/dflash.py), whose weight names the export kept
        return _load_export(path, _dflash_draft_config(raw, path, key, redo), target_dir, key, redo,
                            speculators=False, target_keys=target_keys)
    raw = formats.flat_config(raw)  # serve.format=speculators: its layer config, P-EAGLE's parallel_drafting
    # vLLM's ids: top level (exports since serve/formats.py; eagle_config's are SGLang's, id - 1),
    # else eagle_config's (older exports wrote vLLM's ids there).
    nested = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or nested.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise ConfigError(f"{key}: {path / 'config.json'} has no eagle_aux_hidden_state_layer_ids")
    return _load_export(path, {**raw, "eagle_aux_layer_ids": [int(i) for i in ids]}, target_dir, key, redo,
                        speculators=bool(speculators), target_keys=target_keys)


def _dflash_draft_config(raw: dict[str, Any], path: Path, key: str, redo: str) -> dict[str, Any]:
    """The draft config a DFlash checkpoint records (``train/dflash.py`` ``configure``), from its
    export's ``config.json``: vLLM's flat one (``dflash_config``, ids = vLLM id - 1) or speculators'
    (``transformer_layer_config``, vLLM's ids)."""
    try:
        if raw.get("speculators_model_type") == "dflash":
            cfg = {**raw["transformer_layer_config"], "draft_vocab_size": raw["draft_vocab_size"],
                   "target_hidden_size": raw["target_hidden_size"]}
            ids, mask = raw["aux_hidden_state_layer_ids"], raw["mask_token_id"]
        else:
            cfg = dict(raw)
            ids = [int(i) + 1 for i in raw["dflash_config"]["target_layer_ids"]]
            mask = raw["dflash_config"]["mask_token_id"]
        cfg.update(dflash=True, dflash_block_size=int(raw["block_size"]), mask_token_id=int(mask),
                   eagle_aux_layer_ids=[int(i) for i in ids])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: {shown_path(path / 'config.json')}: not a DFlash draft config "
                          f"({_why(exc)}); {redo}") from None
    return cfg


def _load_export(path: Path, raw: dict[str, Any], target_dir, key: str, redo: str, *, speculators: bool,
                 target_keys: dict[str, str] | None = None):
    """The draft of the exported folder ``path`` (``raw``: its config as the draft's model reads it)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    try:
        cfg = LlamaConfig.from_dict(raw)
        model = dflash.DFlashDraft(cfg) if dflash.is_dflash(cfg) else Eagle3Draft(cfg)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{key}: {shown_path(path / 'config.json')}: not a draft config "
                          f"({_why(exc)}); {redo}") from None
    try:
        state = load_file(str(path / "model.safetensors"))
        if fp8.is_fp8_state(state):  # FP8 export: weights = codes * per-channel scale
            state = fp8.dequantise_state(state)
        if speculators:  # speculators' ``layers.0.*``: the draft's ``midlayer.*``
            state = formats.flat_tensors(state)
        state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
    except (OSError, SafetensorError, KeyError, RuntimeError) as exc:  # truncated, or shapes off the config
        raise ConfigError(f"{key}: {shown_path(path / 'model.safetensors')}: unreadable or not "
                          f"matching config.json ({_why(exc)}); {redo}") from None
    # A draft of the target's whole vocabulary is exported without d2t / t2d (vLLM has no map for it to
    # load): the buffers' zeros are its identity map.
    whole = model.config.draft_vocab_size == model.config.vocab_size
    missing = [k for k in missing if not k.startswith("embed_tokens.") and not (whole and k in ("d2t", "t2d"))]
    if missing or unexpected:
        raise ConfigError(f"{key}: {path} weights do not match its config "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    _check_mask_token(model, path / "config.json", key, redo)
    return _with_embeddings(model, target_dir, target_keys=target_keys).eval()


def _check_mask_token(model, where: Path, key: str, redo: str) -> None:
    """A P-EAGLE or DFlash draft's ``mask_token_id`` (fed at every mask slot) is a token id of the
    vocabulary: anything else would fail mid-decode, or be read as another id (2.5 as 2)."""
    if not (dflash.is_dflash(model.config) or getattr(model.config, "parallel_drafting", False)):
        return
    tid, vocab = getattr(model.config, "mask_token_id", None), model.config.vocab_size
    if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab:
        raise ConfigError(f"{key}: {shown_path(where)}: mask_token_id {tid!r} is not a token id of the target's "
                          f"vocabulary (0..{vocab - 1}); {redo}")


def _with_embeddings(model, target_dir: str | Path, *, target_keys: dict | None = None):
    """``model`` with the target's embeddings (vLLM shares them with the draft), once the target is
    checked to be one the draft fits: its vocabulary and width, and the aux layers the draft reads. A
    target of another shape is refused naming run.target (the draft is not damaged)."""
    cfg = target_config(target_dir)
    where = shown_path(Path(target_dir) / "config.json")
    for name, mine in (("vocab_size", model.config.vocab_size), ("hidden_size", model.config.target_hidden_size)):
        if cfg.get(name) != mine:
            raise ConfigError(f"run.target: {where} has {name} {cfg.get(name)}, the draft was trained on a target "
                              f"with {mine}; evaluate it with the target it was trained for")
    layers = cfg.get("num_hidden_layers")
    bad = [i for i in model.config.eagle_aux_layer_ids if not isinstance(layers, int) or not 0 <= i < layers]
    if bad:
        raise ConfigError(f"run.target: {where} has {layers} layers, the draft reads aux layers {bad}; "
                          "evaluate it with the target it was trained for")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(load_target_tensors(target_dir, keys=target_keys, only=("embed",))["embed"])
    return model


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:120]}" if text else type(exc).__name__


def _checkpoint_draft(path: Path, key: str):
    """:func:`load_checkpoint` (the draft, without the target's embeddings, and its record), with a
    damaged checkpoint as one line naming its file."""
    redo = "the checkpoint is damaged: train again (`train run`)"
    try:
        return load_checkpoint(path)
    except (OSError, SafetensorError, RuntimeError) as exc:  # weights truncated, missing, or shapes off
        raise ConfigError(f"{key}: {shown_path(path / WEIGHTS)}: unreadable or not matching {INFO} "
                          f"({_why(exc)}); {redo}") from None
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # checkpoint.json lacks what it needs
        raise ConfigError(f"{key}: {shown_path(path / INFO)}: not a draft checkpoint record "
                          f"({_why(exc)}); {redo}") from None


def load_target(target_dir: str | Path, *, trust_remote_code: bool = False):
    """(HF causal LM in its config dtype, tokenizer, stop token ids as vLLM uses them)."""
    from transformers import GenerationConfig

    model = load_causal_lm(target_dir, trust_remote_code=trust_remote_code, dtype="auto").eval()
    tok = load_tokenizer(target_dir, trust_remote_code=trust_remote_code)
    stops = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    try:
        pinned = pinned_revision(target_dir)  # run.target_revision of a hub id
        eos = GenerationConfig.from_pretrained(str(target_dir), **({"revision": pinned} if pinned else {})).eos_token_id
        stops |= set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    except OSError:
        pass
    return model, tok, stops


def prompt_ids(tok, prompt: dict, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a prompt: ``prompt_token_ids`` as given, a raw held-out prompt's text, or the chat
    template (as vLLM's chat); ``prompts.prompt_tokens``."""
    return prompt_tokens(tok, prompt, chat_template_kwargs)


def _aux(hidden_states, layer_ids) -> torch.Tensor:
    """[T, n_aux*H]: HF ``hidden_states[j]`` (== vLLM layer id j) for each id, ascending."""
    return torch.cat([hidden_states[j][0] for j in layer_ids], dim=-1)


@torch.inference_mode()
def features(target_model, draft, ids: list[int]) -> torch.Tensor:
    """[len(ids), H]: the draft's combined features of the target's aux states over ``ids``, one
    target forward (causal, so any prefix's features are its rows)."""
    out = target_model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    aux = _aux(out.hidden_states, sorted(draft.config.eagle_aux_layer_ids))
    return draft.combine(aux.to(next(draft.parameters()).dtype))


def propose(draft, seq: list[int], feats: torch.Tensor, k: int) -> list[int]:
    """k greedy draft tokens (target ids) for the verified sequence ``seq`` (features of seq[:-1])."""
    if dflash.is_dflash(draft.config):  # train.family=dflash: vLLM's one block forward (train/dflash.py)
        return dflash.propose(draft, seq, feats, k)
    if getattr(draft.config, "parallel_drafting", False):  # train.family=peagle: one forward (train/peagle.py)
        return peagle.propose(draft, seq, feats, k)
    t = feats.shape[0]
    assert t == len(seq) - 1, (t, len(seq))
    toks = torch.tensor([seq[1:]])
    pos = torch.arange(t)[None]
    cache: list = []
    # One document: the draft's attention builds its causal mask (and its sliding window, if any).
    doc = torch.zeros(1, t + k, dtype=torch.long)
    normed, hidden = draft.step(toks, feats[None], pos, cache, doc[:, :t])
    out: list[int] = []
    for j in range(k):
        d = draft.draft_to_target(draft.logits(normed[:, -1]).argmax(-1))
        out.append(int(d))
        if j + 1 < k:  # step j+1 at position t-1+(j+1): one query attending to step-0 keys + own chain
            seen = chunk_doc_mask(doc, t + j, t + j + 1, window=draft.midlayer.self_attn.window)[..., :t]
            normed, hidden = draft.step(d[None], hidden[:, -1:], torch.tensor([[t + j]]), cache, seen)
    return out


@torch.inference_mode()
def decode(target_model, draft, ids: list[int], *, k: int, max_tokens: int, stop_ids: set[int],
           sample_id: str = "") -> RequestAL:
    """Greedy speculative decoding of one prompt; output trimmed like vLLM's (max_tokens, stop)."""
    from transformers import DynamicCache

    layer_ids = sorted(draft.config.eagle_aux_layer_ids)
    dtype = next(draft.parameters()).dtype
    cache = DynamicCache()
    out = target_model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                       output_hidden_states=True)
    feats = draft.combine(_aux(out.hidden_states, layer_ids).to(dtype))
    seq = list(ids) + [int(out.logits[0, -1].argmax())]
    gen = seq[len(ids):]
    hist = [0] * (k + 1)

    def finished() -> bool:
        return len(gen) >= max_tokens or any(t in stop_ids for t in gen)

    while not finished():
        drafts = propose(draft, seq, feats, k)
        inp = [seq[-1]] + drafts
        out = target_model(input_ids=torch.tensor([inp]), past_key_values=cache, use_cache=True,
                           output_hidden_states=True)
        greedy = out.logits[0].argmax(-1).tolist()
        a = 0
        while a < k and drafts[a] == greedy[a]:
            a += 1
        hist[a] += 1
        new = drafts[:a] + [greedy[a]]
        # Keep the target's features and KV only for the accepted inputs inp[0 .. a].
        aux = _aux(out.hidden_states, layer_ids)[: a + 1]
        feats = torch.cat([feats, draft.combine(aux.to(dtype))])
        if a < k:  # remove the rejected positions (a negative count = tokens to remove)
            cache.crop(-(k - a))
        seq += new
        gen += new
    # vLLM appends tokens one by one and stops at max_tokens or the first stop token (kept).
    cut = min([max_tokens] + [i + 1 for i, t in enumerate(gen) if t in stop_ids])
    return RequestAL(sample_id, list(ids), gen[:cut], hist)


def trained_depth(draft) -> int | None:
    """The tokens a round ``draft`` (from :func:`load_draft`) was trained to draft: a DFlash draft's
    block size - 1, a P-EAGLE checkpoint's slots, an export's ``trained_num_speculative_tokens``;
    None when its config does not say (an EAGLE-3 train checkpoint keeps ``ttt_steps`` elsewhere)."""
    cfg = draft.config
    block = getattr(cfg, "dflash_block_size", None) if dflash.is_dflash(cfg) else None
    for value in (block - 1 if isinstance(block, int) else None, getattr(cfg, "trained_num_speculative_tokens", None),
                  getattr(cfg, "peagle_num_slots", None)):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


def summarise(results: list[RequestAL]) -> dict:
    """The shape of one group row of ``evaluate_al``: pooled and per-request AL, per position."""
    k = max((len(r.histogram) for r in results), default=1) - 1
    rounds = sum(sum(r.histogram) for r in results)
    accepted = sum(j * c for r in results for j, c in enumerate(r.histogram))
    per_pos = tuple(sum(sum(r.histogram[j:]) for r in results) for j in range(1, k + 1))
    counters = SpecCounters(rounds, rounds * k, accepted, per_pos)
    hists = [dataclasses.make_dataclass("H", ["histogram"])(r.histogram) for r in results]
    return {"prompts": len(results), "output_tokens": sum(len(r.token_ids) for r in results),
            **counters.summary(), **per_request_summary(hists)}


def offline_al(*, target: str | Path, draft: str | Path, groups: dict[str, list[dict]],
               num_speculative_tokens: int, max_tokens: int, ignore_eos: bool = False,
               num_threads: int = 1, trust_remote_code: bool = False, draft_key: str = "evaluate.draft",
               chat_template_kwargs: dict | None = None, target_keys: dict[str, str] | None = None) -> dict:
    """Offline AL per group and overall; ``groups`` as ``evaluate.prompts`` returns them.

    Returns ``{"overall": row, "domains": {group: row}, "modes": {chat/raw: row}, "outputs": {sample_id: ids}}``,
    rows shaped like ``evaluate_al``'s. ``num_threads``: torch intra-op threads while decoding
    (1 by default: the tensors are small and extra threads spin on a busy machine; measured 18x
    slower with 2 threads beside another job on 2 cores). ``trust_remote_code``: ``run.trust_remote_code``;
    ``chat_template_kwargs``: as ``evaluate.chat_template_kwargs`` resolves; ``draft_key``: where ``draft``
    came from, named by its errors; ``target_keys``: ``run.target_keys``, where an exported draft finds the
    target's embeddings (a train checkpoint records where its training found them).
    """
    if num_speculative_tokens < 1:
        raise ConfigError(f"evaluate.num_speculative_tokens: must be >= 1, got {num_speculative_tokens}")
    if max_tokens < 1:
        raise ConfigError(f"evaluate.max_tokens: must be >= 1, got {max_tokens}")
    # first: a damaged draft is refused before the target is loaded
    dmodel = load_draft(draft, target, key=draft_key, target_keys=target_keys)
    depth = trained_depth(dmodel)
    if depth is not None and num_speculative_tokens > depth:  # as serving it warns (eaglenest.engine)
        log.warning("evaluate.num_speculative_tokens %d is past the %d tokens a round the draft %s was trained to "
                    "draft: its proposals past %d come from positions it never learnt", num_speculative_tokens,
                    depth, draft, depth)
    model, tok, stops = load_target(target, trust_remote_code=trust_remote_code)
    dmodel = dmodel.to(next(model.parameters()).dtype)
    if dmodel.config.vocab_size != model.config.vocab_size:
        raise ConfigError(f"{draft_key}: vocab {dmodel.config.vocab_size} differs from the target's "
                          f"{model.config.vocab_size}")
    stops = set() if ignore_eos else stops
    domains, outputs, everything, modes = {}, {}, [], {}
    threads = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for name, prompts in groups.items():
            res = _decode_group(model, dmodel, tok, name, prompts, k=num_speculative_tokens,
                                max_tokens=max_tokens, stops=stops, chat_template_kwargs=chat_template_kwargs)
            domains[name] = summarise(res)
            outputs.update({r.sample_id: r.token_ids for r in res})
            everything += res
            for p, r in zip(prompts, res):  # chat or raw, as each prompt was decoded
                modes.setdefault(mode_of(p), []).append(r)
            log.info("%s: offline AL %.3f over %d prompts", name, domains[name]["acceptance_length"] or 0,
                     len(res))
    finally:
        torch.set_num_threads(threads)
    return {"target": str(target), "draft": str(draft), "num_speculative_tokens": num_speculative_tokens,
            "max_tokens": max_tokens, "temperature": 0.0, "method": "offline (HF target, greedy)",
            "overall": summarise(everything), "domains": domains,
            "modes": {mode: summarise(rs) for mode, rs in sorted(modes.items())}, "outputs": outputs}


def _decode_group(model, dmodel, tok, name, prompts, *, k, max_tokens, stops,
                  chat_template_kwargs=None) -> list[RequestAL]:
    return [decode(model, dmodel, prompt_ids(tok, p, chat_template_kwargs), k=k, max_tokens=max_tokens, stop_ids=stops,
                   sample_id=p.get("sample_id", f"{name}-{i}")) for i, p in enumerate(prompts)]


__all__ = ["RequestAL", "decode", "features", "load_draft", "load_target", "offline_al", "prompt_ids", "propose",
           "summarise", "trained_depth"]
