"""A kernel build killed midway must not hang any later start: the build lock dies with its holder, and the lock
file torch's loader leaves behind is removed instead of waited on."""

import os
import signal
import subprocess
import sys
import textwrap

from services.engine.layers.kernels import _BuildLock, build_directory


def test_a_lock_file_left_by_a_killed_build_is_removed(tmp_path):
    folder = tmp_path / "meshserve_x"
    folder.mkdir()
    (folder / "lock").write_text("")  # what torch's FileBaton leaves when its build is killed
    with _BuildLock(folder, "test"):
        assert not (folder / "lock").exists()


def test_the_lock_of_a_killed_holder_is_free(tmp_path):
    folder = tmp_path / "meshserve_x"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from services.engine.layers.kernels import _BuildLock
        with _BuildLock(Path({str(folder)!r}), "test"):
            print("held", flush=True)
            time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.killpg(holder.pid, signal.SIGKILL)  # killed midway through its "build"
        holder.wait(timeout=30)
        taker = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from pathlib import Path
            from services.engine.layers.kernels import _BuildLock
            with _BuildLock(Path({str(folder)!r}), "test"):
                print("taken")
            """)], capture_output=True, text=True, timeout=60)  # a wait on the dead holder times out here
        assert taker.stdout.strip() == "taken", taker.stderr
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)


def test_each_torch_installation_builds_in_its_own_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = build_directory("meshserve_sampler_avx2")
    assert folder.parent.parent == tmp_path and folder.parent.name.startswith("meshserve-torch-")
    assert folder.name == "meshserve_sampler_avx2"
