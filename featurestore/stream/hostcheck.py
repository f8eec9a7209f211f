"""What ``featurestore stream-serve`` checks of its model before its engine joins a cross-host stream
(``xhost.serve``): the model is usable on this host and has the trainer's shape. A failure after
joining would end every rank; here it is one line naming ``--target``."""

from __future__ import annotations

from eaglenest.errors import ConfigError
from eaglenest.featurestore.capture.build import target_facts
from eaglenest.hf import check_target


def check_target_flag(target: str) -> None:
    """stream-serve's ``--target``: a model directory here (or a cached hub id), else one line naming the flag."""
    check_target(target, key="--target", label=f"--target {target}")


def check_trainers_target(target: str) -> None:
    """The trainer's ``run.target`` when stream-serve has no ``--target``: here too, or one line saying
    to give ``--target`` (before this engine joins the group, where its failure would end every rank)."""
    try:
        check_target(target, label=target)  # named below as the trainer's run.target
    except ConfigError as exc:
        raise ConfigError(f"--target: not given, and the trainer's run.target is not usable on this host ({exc}): "
                          "give --target DIR") from None


def check_same_shape(target: str, spec: dict, *, given: bool) -> None:
    """The model this engine loads (``--target``, ``given``; else the trainer's run.target path as it is
    on this host) against the trainer's: the same layer count, width, dtype and vocabulary size, or one
    line before this engine joins. Another model streamed states of another width (the trainer failed on
    its first batch, after the engine start) or, with more layers, a middle layer taken for the last one
    (trained on silently); a copy in another dtype, states of another precision than the trainer's
    features (silently). A spec without ``dtype`` or ``vocab_size`` (an earlier trainer) is not asked them."""
    what = f"--target {target}" if given else f"{target} (the trainer's run.target, as it is on this host)"
    want = {k: int(spec[k]) for k in ("num_layers", "hidden_size", "vocab_size") if spec.get(k) is not None}
    if spec.get("dtype"):
        want["dtype"] = str(spec["dtype"])
    facts = target_facts(target, trust_remote_code=bool(spec.get("trust_remote_code", False)), key=what)
    engine_dtype = str((spec.get("engine") or {}).get("dtype", "auto"))
    if engine_dtype != "auto":  # the trainer's engine setting is what runs, whatever the checkpoint's dtype
        facts["dtype"] = {"half": "float16", "float": "float32"}.get(engine_dtype, engine_dtype)
    differ = [k for k in want if facts[k] is not None and facts[k] != want[k]]  # a config without vocab_size
    if differ:
        got = ", ".join(f"{k} {facts[k]}" for k in differ)
        trainers = ", ".join(f"{k} {want[k]}" for k in differ)
        raise ConfigError(f"{what}: {got}, but the trainer's model has {trainers}: give stream-serve the "
                          "trainer's model (--target DIR)")
