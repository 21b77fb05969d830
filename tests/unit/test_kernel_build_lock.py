"""A kernel build lock left by a killed build must not hang every later worker's start-up."""

import os
import time

from services.engine.kernels import STALE_LOCK_S, _clear_stale_lock


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    stale, fresh = tmp_path / "stale" / "lock", tmp_path / "fresh" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.write_text("")
    old = time.time() - STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    _clear_stale_lock(stale)
    _clear_stale_lock(fresh)
    _clear_stale_lock(tmp_path / "none" / "lock")  # no lock: nothing to do
    assert not stale.exists() and fresh.exists()
