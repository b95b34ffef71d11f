"""The whole-tree memory figure: PSS over a process and its descendants, shared pages once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agentbolt.memory import PeakMemory, descendants, pss_bytes, tree_pss_bytes

pytestmark = pytest.mark.skipif(
    pss_bytes(os.getpid()) is None, reason="needs /proc/<pid>/smaps_rollup (Linux)"
)

HOLD = "import sys; b = bytearray({n}); b[::4096] = b'x' * len(b[::4096]); print('ready', flush=True); sys.stdin.read()"


def _holder(megabytes: int) -> subprocess.Popen[str]:
    """A child holding ``megabytes`` of touched memory until its stdin closes."""
    code = HOLD.format(n=megabytes * 2**20)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_the_tree_counts_the_children() -> None:
    before = tree_pss_bytes()
    assert before is not None and before > 0
    with PeakMemory(interval=0.05) as peak:
        child = _holder(200)
        try:
            assert child.pid in descendants(os.getpid())
            held, child_pss = tree_pss_bytes(), pss_bytes(child.pid)
            peak.sample()
        finally:
            assert child.stdin is not None
            child.stdin.close()
            child.wait(10)
    after = tree_pss_bytes()
    assert child_pss is not None and child_pss > 200 * 2**20
    assert held is not None and after is not None and held - after > 190 * 2**20
    assert peak.peak_bytes is not None and peak.peak_bytes > held - 2**20  # sampled a moment apart
    assert peak.describe().startswith("peak memory: ") and "GB (whole process tree" in peak.describe()


def test_pages_shared_after_fork_count_once() -> None:
    """A forked child that only reads its parent's 300 MB adds little; an RSS sum would double it."""
    data = bytearray(300 * 2**20)
    data[::4096] = b"x" * len(data[::4096])
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: touch nothing, wait to be told to go
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        own = pss_bytes(os.getpid())
        tree = tree_pss_bytes()
        rss_child = int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    finally:
        os.write(write, b"x")
        os.waitpid(pid, 0)
    assert own is not None and tree is not None
    assert rss_child > 250e6  # the child maps the shared pages ...
    assert tree < own + 2 * rss_child / 3 and tree > 300e6  # ... yet they are counted once over the tree


def test_free_heap_pages_go_back_to_the_system():
    """Freed small allocations stay in glibc's heap until trimmed; trimming gives them back."""
    import gc

    from agentbolt.memory import pss_bytes, release_free_memory

    blocks = [bytearray(1000) for _ in range(200_000)]  # ~200 MB of small heap blocks
    pin = [bytearray(1000) for _ in range(100)]  # above them: the heap's top cannot shrink by itself
    held = pss_bytes(os.getpid())
    del blocks
    gc.collect()
    kept = pss_bytes(os.getpid())
    assert held is not None and kept is not None and held - kept < 100 * 2**20  # glibc kept them
    assert release_free_memory() is True
    after = pss_bytes(os.getpid())
    assert after is not None and kept - after > 100 * 2**20
    assert len(pin) == 100


FREED_BETWEEN_PINS = """
import gc, json, os
from agentbolt.memory import large_blocks_mapped, map_large_blocks, pss_bytes

def held_and_kept(size, count):
    \"\"\"MB the process grew by with ``count`` touched blocks of ``size`` bytes, each followed by a
    small malloc block that stays, and MB it still holds once the big ones are freed.\"\"\"
    before = pss_bytes(os.getpid())
    blocks, pins = [], []
    for _ in range(count):
        block = bytearray(size)
        block[::4096] = b"x" * len(block[::4096])
        blocks.append(block)
        pins.append(bytearray(1024))
    held = pss_bytes(os.getpid())
    del blocks
    gc.collect()
    return (held - before) / 2**20, (pss_bytes(os.getpid()) - before) / 2**20
"""

BLOCKS = (
    FREED_BETWEEN_PINS
    + """
with large_blocks_mapped() as mapped:
    held, kept = held_and_kept(2**20, 150)
print(json.dumps([mapped, held, kept]))
"""
)


def test_large_blocks_mapped_are_given_back_when_freed():
    """Inside the block, 1 MB allocations freed between small ones that stay leave the process at
    once, without a trim. In a fresh process: a heap with free room serves such allocations from
    that room, mapped or not."""
    from agentbolt.memory import _glibc_function

    if _glibc_function("mallopt") is None:
        pytest.skip("needs glibc's mallopt")
    out = subprocess.run([sys.executable, "-c", BLOCKS], capture_output=True, text=True, check=True)
    mapped, held, kept = json.loads(out.stdout)
    assert mapped is True
    assert held > 140
    assert kept < 10


def test_large_blocks_mapped_sets_the_threshold_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The threshold is lowered for the block only: on exit it is glibc's ceiling (32 MB), also
    when the block raises; without glibc nothing is called and the block says False."""
    from agentbolt import memory

    calls: list[tuple[int, int]] = []

    def mallopt(param: int, value: int) -> int:
        calls.append((param, value))
        return 1

    monkeypatch.setattr(memory, "_glibc_function", lambda name: mallopt if name == "mallopt" else None)
    with pytest.raises(RuntimeError), memory.large_blocks_mapped(256 * 2**10) as mapped:
        assert mapped is True
        assert calls == [(-3, 256 * 2**10)]
        raise RuntimeError("the pass failed")
    assert calls == [(-3, 256 * 2**10), (-3, 32 * 2**20)]
    monkeypatch.setattr(memory, "_glibc_function", lambda name: None)
    with memory.large_blocks_mapped() as mapped:
        assert mapped is False


KEPT = (
    FREED_BETWEEN_PINS
    + """
ok = map_large_blocks(2**20)
with large_blocks_mapped():  # its exit keeps map_large_blocks' threshold
    pass
print(json.dumps([ok, *held_and_kept(2 * 2**20, 100)]))
"""
)


def test_map_large_blocks_holds_for_the_whole_process():
    """After ``map_large_blocks``, 2 MB blocks freed between small ones that stay leave the process
    at once, also after a ``large_blocks_mapped`` block has ended (fresh process)."""
    from agentbolt.memory import _glibc_function

    if _glibc_function("mallopt") is None:
        pytest.skip("needs glibc's mallopt")
    out = subprocess.run([sys.executable, "-c", KEPT], capture_output=True, text=True, check=True)
    ok, held, kept = json.loads(out.stdout)
    assert ok is True
    assert held > 190
    assert kept < 10


CACHE_PROBE = """
import os, sys, torch
from agentbolt.memory import bound_kernel_cache
os.environ.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
os.environ.pop("DNNL_PRIMITIVE_CACHE_CAPACITY", None)
if sys.argv[1] == "bound":
    assert bound_kernel_cache(2) is True
os.environ["ONEDNN_VERBOSE"] = "profile_create"  # one line per primitive built: cache_hit/miss
x = torch.randn(1, 3, 16, 16)
for k in (5, 7, 9, 5):  # three shapes, then the first again
    torch.nn.functional.conv2d(x, torch.randn(4, 3, k, k))
"""


@pytest.mark.parametrize("bound", [True, False])
def test_bound_kernel_cache_drops_the_oldest_primitives(bound: bool) -> None:
    """With two primitives kept, the convolution of the first shape, run again after two others,
    is built afresh (oneDNN's cache_miss); with oneDNN's default it comes from the cache. Set
    inside the process, before the first product, as ``agentbolt demo`` sets it."""
    import torch

    assert torch.backends.mkldnn.is_available(), "this PyTorch build has no oneDNN"
    out = subprocess.run(
        [sys.executable, "-c", CACHE_PROBE, "bound" if bound else "default"],
        capture_output=True,
        text=True,
        check=True,
    )
    builds = [line for line in out.stdout.splitlines() if ",create:" in line and ",convolution," in line]
    assert len(builds) == 4, out.stdout[-2000:]
    assert all("create:cache_miss" in line for line in builds[:3])
    assert ("create:cache_miss" if bound else "create:cache_hit") in builds[3]


def test_bound_kernel_cache_leaves_a_setting_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbolt.memory import KERNEL_CACHE_CAPACITY, bound_kernel_cache

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "8")
    assert bound_kernel_cache() is False
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
    monkeypatch.delenv("DNNL_PRIMITIVE_CACHE_CAPACITY")
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    assert bound_kernel_cache() is False
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "64"
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert bound_kernel_cache() is True
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(KERNEL_CACHE_CAPACITY)


SKIP_SCENARIO = """
import json, subprocess, sys
import agentbolt.memory as memory

peak = memory.PeakMemory()
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\\n"
first = peak.sample()
child.stdin.close()
child.wait(10)
out = {"first": first, "peak1": peak.peak_bytes, "skipped1": peak.skipped}
walks = []
real = memory.tree_pss_bytes

def counted(pid=None):
    walks.append(pid)
    return real(pid)

memory.tree_pss_bytes = counted
out["second"] = peak.sample()
out.update(skipped2=peak.skipped, walks2=list(walks), peak2=peak.peak_bytes)
data = bytearray(400 * 2**20)
data[::4096] = b"x" * len(data[::4096])
out["third"] = peak.sample()
out.update(skipped3=peak.skipped, walks3=list(walks), peak3=peak.peak_bytes)
print(json.dumps(out))
"""


def test_samples_below_the_peak_skip_the_page_walk() -> None:
    """Once a peak is held, a sample whose resident sizes sum to no more than it reads no PSS (no
    page walk); one above it does, and raises the peak. Run in a fresh interpreter: there the
    tree's resident sizes are close to its PSS, where a test worker's pages, shared with the
    other workers' (torch's libraries), count once each in RSS but divided in PSS."""
    code = HOLD.format(n=200 * 2**20)
    done = subprocess.run(
        [sys.executable, "-c", SKIP_SCENARIO, code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    first = out["first"]
    assert first is not None and out["peak1"] == first and out["skipped1"] == 0
    # the 200 MB child is gone: the tree's RSS is under the peak
    assert out["second"] is None and out["skipped2"] == 1 and out["walks2"] == [] and out["peak2"] == first
    third = out["third"]
    assert out["walks3"] == [None] and third is not None and third > first + 100 * 2**20
    assert out["peak3"] == third and out["skipped3"] == 1
