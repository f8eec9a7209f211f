import time

import pytest

from eaglenest import faults


def test_delay_sleeps_only_at_the_named_point(monkeypatch):
    monkeypatch.setenv(faults.ENV, "a.b=0.2, c=0")
    t0 = time.perf_counter()
    faults.delay("other")
    faults.delay("c")
    assert time.perf_counter() - t0 < 0.1
    faults.delay("a.b")
    assert time.perf_counter() - t0 >= 0.2


def test_bad_spec_names_the_item():
    with pytest.raises(ValueError, match="'oops'"):
        faults.delays("x=1,oops")
