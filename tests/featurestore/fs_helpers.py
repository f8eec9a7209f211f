"""Synthetic feature rows for feature-store tests (tiny shapes, real Lance)."""

import numpy as np
import pyarrow as pa

from eaglenest.featurestore import schema as S
from eaglenest.featurestore.table import store


def meta(dtype="float32", hidden=8, layer_ids=(2, 4, 5), target="t"):
    return S.FeatureMeta(target=target, layer_ids=tuple(layer_ids), last_layer_id=8, hidden_size=hidden,
                         dtype=dtype, feature_set_id=f"fs-{target}-{'-'.join(map(str, layer_ids))}-{dtype}")


def rows(ids, m, *, num_tokens=4, domain="d", seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for k, sid in enumerate(ids):
        T = num_tokens + k % 3
        aux = rng.standard_normal((T, len(m.layer_ids), m.hidden_size)).astype("float32")
        last = rng.standard_normal((T, m.hidden_size)).astype("float32")
        out.append({"sample_id": sid, "domain": domain, "source": "s", "split": "train", "mode": "chat",
                    "gen_params_id": "g", "num_tokens": T, "num_loss_tokens": T - 1,
                    "input_ids": [(7 * k + j) % 50 for j in range(T)], "loss_mask": [0] + [1] * (T - 1),
                    "aux_hidden": S.encode_tensor(aux, m.dtype), "last_hidden": S.encode_tensor(last, m.dtype)})
    return out


def table(ids, m, **kw):
    return pa.Table.from_pylist(rows(ids, m, **kw), schema=S.features_schema(m))


def big_table(uri: str, *, rows: int, row_mib: int) -> None:
    """A features table of ``rows`` samples of ``row_mib`` MiB of fp32 tensors each (H=1024), written
    8 rows per commit (for the memory-bound tests)."""
    hidden = 1024
    m = meta(hidden=hidden)
    tokens = row_mib * 2**20 // (4 * hidden * 4)
    rng = np.random.default_rng(0)
    for start in range(0, rows, 8):
        batch = []
        for k in range(start, min(rows, start + 8)):
            aux = rng.standard_normal((tokens, 3, hidden), dtype=np.float32)
            last = rng.standard_normal((tokens, hidden), dtype=np.float32)
            batch.append({"sample_id": f"b{k}", "domain": "d", "source": "s", "split": "train", "mode": "chat",
                          "gen_params_id": "g", "num_tokens": tokens, "num_loss_tokens": tokens - 1,
                          "input_ids": [0] * tokens, "loss_mask": [0] + [1] * (tokens - 1),
                          "aux_hidden": S.encode_tensor(aux, m.dtype), "last_hidden": S.encode_tensor(last, m.dtype)})
        store.append(uri, store.FEATURES, pa.Table.from_pylist(batch, schema=S.features_schema(m)), meta=m)


def prompt_rows(n: int, *, seed: int = 0) -> list[dict]:
    """``n`` rows of a prompts table: random token ids, as `featurestore capture` reads them."""
    rng = np.random.default_rng(seed)
    return [{"sample_id": f"s-{i:03d}", "domain": "d", "source": "synthetic", "split": "train", "mode": "raw",
             "messages_json": "[]", "prompt_token_ids": rng.integers(3, 2000, 10).tolist(),
             "response_token_ids": rng.integers(3, 2000, 12).tolist(), "finish_reason": "length",
             "gen_params_id": "g0"} for i in range(n)]


def prompts_store(tmp_path, rows: list[dict], target) -> str:
    """A store at ``tmp_path/store`` whose prompts table holds ``rows``, generated (as lineage says) by ``target``."""
    from eaglenest.featurestore.capture import policy

    uri = str(tmp_path / "store")
    store.append(uri, store.PROMPTS, pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA),
                 lineage={"stage": "ingest", "shard": 0, **policy.lineage_record(str(target))})
    return uri


def forbid_capture_engine(monkeypatch) -> None:
    """Fail the test if a capture gets as far as starting its engine."""
    from eaglenest.featurestore.capture import build

    def started(*args, **kwargs):
        raise AssertionError("the capture started an engine before refusing its input")

    monkeypatch.setattr(build, "Capturer", started)


class StubCapturer:
    """Stands in for the vLLM capture engine (as ``build.Capturer``): zero hidden states of the right
    shape, and a crash after ``die_after`` captures, to test what capture does around the engine."""

    die_after: int | None = None

    def __init__(self, target, layer_ids, num_layers, engine, **kwargs):
        self.layers, self.num_forward_passes = len(layer_ids), 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def stream(self, seqs, **kwargs):
        from eaglenest.errors import StoreError

        for k, s in enumerate(seqs):
            if k == self.die_after:
                raise StoreError("the capture engine died (stub)")
            self.num_forward_passes += 1
            yield np.zeros((len(s), self.layers, 128), np.float32), np.zeros((len(s), 128), np.float32)


def rows_of(tokens: int, n: int = 2) -> list[dict]:
    """:func:`prompt_rows` (seed 3) whose conversations hold ``tokens`` tokens each, prompt and response."""
    rows = prompt_rows(n, seed=3)
    for r in rows:
        r["response_token_ids"] = r["response_token_ids"][: tokens - len(r["prompt_token_ids"])]
    return rows


#: The child: peak RSS growth of one `featurestore query --with-tensors --out` after a warm-up query.
PEAK_CHILD = r"""
import json, sys
from eaglenest.featurestore import cli

def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])

warm, big, out, *extra = sys.argv[1:]  # extra: more arguments of both commands
q = ["query", "--with-tensors", "--sql", "SELECT * FROM features", "--out"]
assert cli.main(q + [out, f"run.store={warm}", *extra]) == 0  # libraries loaded, runtimes started
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS (Linux)
before = kib("VmRSS:")
assert cli.main(q + [out, f"run.store={big}", *extra]) == 0
print(json.dumps({"growth_mib": (kib("VmHWM:") - before) / 1024}))
"""
