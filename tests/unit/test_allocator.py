"""The allocator decision (`lenbatch.runners.allocator`): when serve re-executes with
tcmalloc preloaded, when it goes on as launched, and how the memory map is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from lenbatch.runners.allocator import (
    REEXEC_MARK,
    allocator_in_use,
    find_tcmalloc,
    preload_environment,
)

TC = Path("/opt/lib/libtcmalloc_minimal.so.4")


def test_auto_preloads_found_tcmalloc_and_keeps_an_existing_preload() -> None:
    env, why = preload_environment(
        "auto", {"PATH": "/bin", "LD_PRELOAD": "/x/libiomp5.so"}, "glibc", TC
    )
    assert env is not None
    assert env["LD_PRELOAD"] == f"{TC} /x/libiomp5.so"
    assert env[REEXEC_MARK] == "1" and env["PATH"] == "/bin"
    assert why == f"tcmalloc ({TC}, preloaded)"


def test_auto_without_tcmalloc_goes_on_with_glibc_and_says_what_to_install() -> None:
    env, why = preload_environment("auto", {}, "glibc", None)
    assert env is None
    assert why.startswith("glibc (") and "libtcmalloc-minimal4" in why


def test_tcmalloc_required_but_missing_is_an_error() -> None:
    with pytest.raises(ValueError, match="allocator tcmalloc: no libtcmalloc"):
        preload_environment("tcmalloc", {}, "glibc", None)


@pytest.mark.parametrize("choice", ["auto", "tcmalloc"])
def test_never_reexecutes_twice(choice: str) -> None:
    """A preload the loader ignored (the mark is set, glibc still runs) does not loop."""
    env = {REEXEC_MARK: "1", "LD_PRELOAD": str(TC)}
    if choice == "tcmalloc":
        with pytest.raises(ValueError, match="not in the process's memory map"):
            preload_environment(choice, env, "glibc", TC)
        return
    new, why = preload_environment(choice, env, "glibc", TC)
    assert new is None and why.startswith("glibc (") and "not in the process's memory map" in why


def test_an_allocator_already_loaded_is_kept() -> None:
    assert preload_environment("auto", {}, "jemalloc", TC) == (None, "jemalloc (already loaded)")
    new, why = preload_environment("auto", {REEXEC_MARK: "1"}, "tcmalloc", TC)
    assert new is None and why == "tcmalloc (preloaded at start)"


def test_system_never_reexecutes() -> None:
    assert preload_environment("system", {}, "glibc", TC)[0] is None


def test_allocator_read_from_the_memory_map() -> None:
    line = "7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/{}\n"
    assert allocator_in_use(line.format("libc.so.6")) == "glibc"
    assert allocator_in_use(line.format("libtcmalloc_minimal.so.4.5.9")) == "tcmalloc"
    assert allocator_in_use(line.format("libjemalloc.so.2")) == "jemalloc"


def test_find_tcmalloc_prefers_the_minimal_build_in_the_first_folder(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    assert find_tcmalloc([first, second]) is None
    (second / "libtcmalloc_minimal.so.4").write_bytes(b"")
    (first / "libtcmalloc.so.4").write_bytes(b"")
    assert find_tcmalloc([first, second]) == first / "libtcmalloc.so.4"
    (first / "libtcmalloc_minimal.so.4").write_bytes(b"")
    assert find_tcmalloc([first, second]) == first / "libtcmalloc_minimal.so.4"
