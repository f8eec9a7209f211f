"""Hostile pass on ``featurestore gc`` (qa7): a writer killed between writing a side record's
temporary file and renaming it into place (the head record, gc's lineage record) left that file in
the table's directory for good; gc sweeps it once it is older than the grace period, as it sweeps a
killed writer's checksum temporaries."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from eaglenest.errors import StoreError
from eaglenest.featurestore.table import maintenance, store

import fs_helpers as H  # on sys.path via conftest

#: A writer SIGKILLed in ``objects.write_text`` after its temporary file is written, before the rename.
KILLED = ("import os, signal, sys\n"
          "from eaglenest.featurestore.table import base\n"
          "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
          "base.record_head(sys.argv[1], 'features', 99)\n")


def test_gc_sweeps_a_killed_writers_head_record_temporary(tmp_path):
    uri, m = str(tmp_path / "my store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a0", "a1"], m), meta=m)
    head = store.head_version(uri, store.FEATURES)
    table_dir = store.table_path(uri, store.FEATURES)
    before = set(table_dir.iterdir())
    proc = subprocess.run([sys.executable, "-c", KILLED, uri], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    (left,) = set(table_dir.iterdir()) - before
    assert left.name.startswith(store.HEAD_FILE + ".tmp") and store.head_version(uri, store.FEATURES) == head
    kept = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=1)
    assert kept["temporary_files_removed"] == 0 and left.exists()  # young: it may be a live writer's
    old = time.time() - 2 * 3600
    os.utime(left, (old, old))
    swept = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=1)
    assert swept["temporary_files_removed"] == 1 and not left.exists()
    assert store.head_version(uri, store.FEATURES) == head and store.sample_ids(uri, store.FEATURES) == {"a0", "a1"}
    assert maintenance.verify(uri, store.FEATURES)["ok"]


@pytest.mark.parametrize("hours", [{"grace_hours": float("inf")}, {"older_than_hours": float("inf")},
                                   {"grace_hours": float("nan")}, {"grace_hours": -1.0}])
def test_gc_refuses_hours_that_are_not_finite_as_its_message_says(tmp_path, hours):
    """``--grace-hours inf`` was taken (and swept nothing) while the refusal of ``--older-than-hours inf``
    said both must be finite."""
    uri, m = str(tmp_path / "s"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a0"], m), meta=m)
    with pytest.raises(StoreError, match="must be finite and >= 0"):
        maintenance.gc(uri, store.FEATURES, **{"older_than_hours": 0.0, "grace_hours": 1.0, **hours})
