"""The streaming tests' engine settings and prompts (``test_stream.py``, ``test_stream_xhost.py`` and
its rank processes), and the captured store they share (``conftest.stream_store``)."""

import numpy as np
import pyarrow as pa

from eaglenest.engine import EngineConfig
from eaglenest.featurestore import schema as S
from eaglenest.featurestore.capture.build import capture
from eaglenest.featurestore.config import FeaturestoreConfig
from eaglenest.featurestore.table import store

# max_num_seqs=1: one request per forward pass in both paths, so the fp32 numerics are the same.
FS = FeaturestoreConfig(batch_size=8, engine=EngineConfig(max_model_len=512, memory_fraction=0.1, max_num_seqs=1))


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        p, r = rng.integers(3, 2000, 10 + 3 * i).tolist(), rng.integers(3, 2000, 16 + i).tolist()
        rows.append({"sample_id": f"s-{i:03d}", "domain": f"d{i % 2}", "source": "synthetic", "split": "train",
                     "mode": "raw", "messages_json": "[]", "prompt_token_ids": p, "response_token_ids": r,
                     "finish_reason": "length", "gen_params_id": "g0"})
    return pa.Table.from_pylist(rows, schema=S.PROMPTS_SCHEMA)


def captured_store(uri: str, target: str, n: int) -> str:
    """``n`` conversations captured to the features table of a new store at ``uri`` by the table path."""
    store.append(uri, store.PROMPTS, prompts(n))
    capture(target=target, store_uri=uri, cfg=FS)
    return uri
