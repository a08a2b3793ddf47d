"""The CPU actors' malloc: tcmalloc preloaded where the machine has it (ray.allocator)."""

import pytest

from dorarl.config import ConfigError
from dorarl.runtime import malloc
from dorarl.runtime.actors import actor_env
from dorarl.runtime.ray_config import RayConfig

TCMALLOC = malloc.find_tcmalloc()


def test_the_preload_goes_first_and_keeps_what_the_process_was_given(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "libother.so libtcmalloc_minimal.so.4")
    env = malloc.preload_env("libtcmalloc_minimal.so.4")
    assert env == {"LD_PRELOAD": "libtcmalloc_minimal.so.4 libother.so"}
    assert malloc.preload_env(None) == {}


def test_only_actors_on_the_cpu_get_it_and_engines_keep_their_thread_count(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    lib = "libtcmalloc_minimal.so.4"
    assert actor_env("cpu", lib, 2)["env_vars"] == {"LD_PRELOAD": lib, "OMP_NUM_THREADS": "2"}
    assert actor_env("cuda:0", lib, 2)["env_vars"] == {"OMP_NUM_THREADS": "2"}
    assert actor_env("cpu", None)["env_vars"] == {}


def test_asking_for_tcmalloc_where_there_is_none_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setattr(malloc, "find_tcmalloc", lambda: None)
    with pytest.raises(ConfigError, match=r"^ray\.allocator: .*libtcmalloc-minimal4"):
        RayConfig(allocator="tcmalloc").validate()
    assert malloc.preload_library("auto") is None
    assert malloc.preload_library("system") is None


def test_system_never_preloads(monkeypatch):
    monkeypatch.setattr(malloc, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    assert malloc.preload_library("system") is None
    assert malloc.preload_library("auto") == "libtcmalloc_minimal.so.4"


def test_a_library_is_seen_in_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.9\n"
        "7f02-7f03 rw-p 00000000 00:00 0 \n"
    )
    assert malloc.loaded("libtcmalloc_minimal.so.4", maps)
    assert not malloc.loaded("libjemalloc.so.2", maps)
    assert not malloc.loaded("libtcmalloc_minimal.so.4", tmp_path / "absent")


@pytest.mark.skipif(TCMALLOC is None, reason="no tcmalloc on this machine (.ci/run installs it)")
@pytest.mark.usefixtures("shared_ray")
def test_an_actor_started_with_the_env_runs_on_tcmalloc():
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def mapped(self, library: str) -> bool:
            from dorarl.runtime.malloc import loaded

            return loaded(library)

    on = Probe.options(runtime_env=actor_env("cpu", TCMALLOC)).remote()
    off = Probe.options(runtime_env=actor_env("cpu", None)).remote()
    try:
        assert ray.get(on.mapped.remote(TCMALLOC), timeout=120)
        assert not ray.get(off.mapped.remote(TCMALLOC), timeout=120)
    finally:
        ray.kill(on)
        ray.kill(off)


def _run_python(code: str) -> list[str]:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DORARL_PRELOADED")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def _reexec_code(own: bool) -> str:
    return (
        "from dorarl.runtime import malloc\n"
        "print('start', flush=True)\n"
        + ("malloc.own_process()\n" if own else "")
        + f"malloc.reexec_on({TCMALLOC!r})\n"
        f"print(malloc.loaded({TCMALLOC!r}), malloc.describe({TCMALLOC!r}))\n"
    )


@pytest.mark.skipif(TCMALLOC is None, reason="no tcmalloc on this machine (.ci/run installs it)")
def test_the_program_starts_again_on_the_library_once():
    """What `dorarl bench peers` does so that TRL, in its process, gets the actors' malloc."""
    assert _run_python(_reexec_code(own=True)) == ["start", "start", "True", TCMALLOC]


@pytest.mark.skipif(TCMALLOC is None, reason="no tcmalloc on this machine (.ci/run installs it)")
def test_a_callers_process_is_never_replaced():
    """Called from a test or a notebook (not `dorarl` itself), the command runs where it is."""
    assert _run_python(_reexec_code(own=False)) == ["start", "False", "glibc", "malloc"]
