"""Mutation audit of the newest feature-store tests (QA pass 12, honest tests): each test kills a plausible
bug the qa12 tests of the covered module let through, checked from first principles."""

from __future__ import annotations

import os
import time

import pytest

from eaglenest.errors import ConfigError
from eaglenest.featurestore.stream.addr import parse_addr
from eaglenest.featurestore.table import maintenance, store

import fs_helpers as H  # on sys.path via conftest


def _age(path, hours: float) -> None:
    old = time.time() - hours * 3600
    os.utime(path, (old, old))


def test_gc_keeps_an_uncommitted_data_file_inside_the_grace_period(tmp_path):
    # A Lance data file of no version, written half an hour ago, may be a writer's fragment not committed
    # yet: with grace_hours=1 it stays; two hours old it goes. (Only files aged past the grace were tested, so
    # a sweep that ignored the grace passed.)
    uri, m = str(tmp_path / "store"), H.meta()
    store.append(uri, store.FEATURES, H.table(["a0", "a1"], m), meta=m)
    data = store.table_path(uri, store.FEATURES) / "data"
    (committed,) = list(data.iterdir())
    young, old = data / ("1" * 24 + "e" * 26 + ".lance"), data / ("2" * 24 + "d" * 26 + ".lance")
    for path, hours in ((young, 0.5), (old, 2.0)):
        path.write_bytes(committed.read_bytes())
        _age(path, hours)
    report = maintenance.gc(uri, store.FEATURES, older_than_hours=0, grace_hours=1)
    assert report["uncommitted_files_removed"] == 1, report
    assert young.exists() and not old.exists() and committed.exists()
    assert store.sample_ids(uri, store.FEATURES) == {"a0", "a1"}


@pytest.mark.parametrize("port", [0, 65536, 99999])
def test_a_port_outside_1_to_65535_is_refused(port):
    # TCP ports are 16-bit and 0 asks the system for any: neither is an address to meet at. The qa12 tests
    # used valid ports only, so an upper bound one too high passed.
    with pytest.raises(ConfigError, match=rf"^--addr: host:port of the stream's store, got 'node-1:{port}'$"):
        parse_addr(f"node-1:{port}", "--addr")


@pytest.mark.parametrize("port", [1, 65535])
def test_the_first_and_last_ports_are_accepted(port):
    assert parse_addr(f"node-1:{port}", "--addr") == ("node-1", port)
