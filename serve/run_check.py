"""``serve export``'s check that the checkpoint folder's training finished.

``train run`` writes ``checkpoint.json`` only when a run finishes; while it trains (and after a kill)
its folder holds the run's training state (``state/``, ``trainer.json`` with ``finished: false``) and,
if an earlier run of another recipe finished there, that run's checkpoint.json. Exporting then would
publish the earlier run's draft under the new recipe without a word, or fail with "no checkpoint.json"
when the first run was cut short. Both are refused in one line naming the step the training stopped at
and how to go on (``train run`` resumes it). Trade-off: a state that cannot be read is left to
``train run`` to report (the checkpoint beside it is exported as it is).
"""

from __future__ import annotations

from pathlib import Path

from eaglenest.errors import StoreError
from eaglenest.paths import shown_path
from eaglenest.train.checkpoint import INFO, read_info
from eaglenest.train.state import read_latest

#: Where ``train run`` keeps its training state, in its output folder.
STATE = "state"


def check_finished(ckpt_dir: str | Path, *, key: str = "serve.checkpoint_subdir") -> None:
    """Refuse (StoreError) a checkpoint folder whose latest training run stopped before it finished."""
    ckpt = Path(ckpt_dir)
    try:
        latest = read_latest(ckpt / STATE)
    except (StoreError, OSError):
        return
    if latest is None or latest.get("finished", True) is not False:  # (a state saved before the flag: finished)
        return
    stopped = f"the training in {shown_path(ckpt)} stopped at step {latest.get('step')} before it finished (or is " \
              "still running)"
    if not (ckpt / INFO).is_file():
        raise StoreError(f"{key}: {stopped} and has saved no checkpoint yet: run `train run` again to resume it, "
                         "then export")
    try:
        step = read_info(ckpt).get("step")
    except StoreError:
        step = "?"
    raise StoreError(f"{key}: {stopped}; its {INFO} (step {step}) is an earlier run's: run `train run` again to "
                     "resume it, then export (or export that earlier checkpoint from a copy of its folder)")
