"""The second-level KV tiers of issue 46 (nanokv_cli/engine/tiers): the setting's spelling, the
host tier, and the disk tier's round trips, bounds, restarts and faults (truncation, flipped
bytes, foreign files, unusable paths, a second process, writes torn by a kill)."""

from __future__ import annotations

import ast
import errno
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanokv_cli.engine.tiers import disk as disk_module
from nanokv_cli.engine.tiers.base import Tier, TierUnavailable
from nanokv_cli.engine.tiers.disk import DiskTier
from nanokv_cli.engine.tiers.factory import open_tier
from nanokv_cli.engine.tiers.fingerprint import Fingerprint
from nanokv_cli.engine.tiers.host import HostTier
from nanokv_cli.engine.tiers.layout import FILE_HEADER_BYTES, file_name, slot_size
from nanokv_cli.engine.tiers.model_tier import ModelTier
from nanokv_cli.engine.tiers.spec import TierSpec, format_size, parse_size, parse_tier

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

# 1 KiB blocks (2 layers x K/V x 4 tokens x 2 heads x 8 dims x 4 bytes): one page per slot.
FP_ARGS = ("test-model-digest", "float32", "none", "float32", 4, 2, 2, 8)
FP = Fingerprint(*FP_ARGS)
SLOT = slot_size(FP)
# 512 KiB blocks for the kill test, so a kill often lands inside a write.
BIG_ARGS = ("big-model", "float32", "none", "float32", 16, 8, 4, 128)
BIG = Fingerprint(*BIG_ARGS)


def size_for(slots: int, fingerprint: Fingerprint = FP) -> int:
    return FILE_HEADER_BYTES + slots * slot_size(fingerprint)


def tokens_of(k: int, fingerprint: Fingerprint = FP) -> list[int]:
    return [k * 1000 + i for i in range(fingerprint.block_size)]


def block_of(k: int, fingerprint: Fingerprint = FP) -> torch.Tensor:
    """Block ``k``'s K/V: seeded, so another process makes the same one."""
    generator = torch.Generator().manual_seed(k)
    block = torch.randn(fingerprint.block_shape, generator=generator)
    return block.to(fingerprint.torch_kv_dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """An integer view, so comparisons are bit-exact (NaN, -0.0 included)."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


def blank(fingerprint: Fingerprint = FP) -> torch.Tensor:
    return torch.full(fingerprint.block_shape, 7.0).to(fingerprint.torch_kv_dtype)


def loads(tier, k: int, fingerprint: Fingerprint = FP) -> bool:
    """Whether block ``k`` restores, and bit-exact when it does."""
    out = blank(fingerprint)
    if not tier.load(k, tokens_of(k, fingerprint), out):
        return False
    assert torch.equal(bits(out), bits(block_of(k, fingerprint))), f"block {k} restored wrong"
    return True


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}


# -- spec ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("disk:/var/kv:8GiB", TierSpec("disk", 8 * 1024**3, "/var/kv")),
        ("host:512MiB", TierSpec("host", 512 * 1024**2)),
        ("host:2G", TierSpec("host", 2 * 1024**3)),
        ("disk:cache:100M", TierSpec("disk", 100 * 1024**2, "cache")),
        ("disk:/mnt/a:b/kv:4096", TierSpec("disk", 4096, "/mnt/a:b/kv")),
        ("disk:/x:5GB", TierSpec("disk", 5 * 1000**3, "/x")),
        (" HOST:1.5gib ", TierSpec("host", 3 * 512 * 1024**2)),
        ("host:64k", TierSpec("host", 65536)),
    ],
)
def test_parse_tier_accepts_the_spelling(text, expected):
    assert parse_tier(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "disk::8GiB",
        "disk:  :8GiB",
        "disk:/x:0",
        "disk:/x:-1G",
        "disk:/x:0.1",
        "tape:/x:1G",
        "host:/x:1G",
        "disk:/x",
        "host:",
        "host:12XB",
        "host:1iB",
        "disk:/x:GiB",
    ],
)
def test_parse_tier_rejects_bad_settings_showing_the_spelling(text):
    with pytest.raises(ValueError) as caught:
        parse_tier(text)
    assert "disk:PATH:SIZE" in str(caught.value) or "host:SIZE" in str(caught.value)


def test_sizes_round_trip_through_their_display():
    for size in (1, 4095, 4096, 3 * 1024**2, 8 * 1024**3, 5 * 10**9):
        assert parse_size(format_size(size)) == size
    assert str(parse_tier("disk:/a:b:1GiB")) == "disk:/a:b:1GiB"


# -- fingerprint -----------------------------------------------------------------------------


def test_fingerprint_identity_and_serialisation():
    assert Fingerprint.from_bytes(FP.to_bytes()) == FP
    assert Fingerprint(*FP_ARGS[:3], "torch.float32", *FP_ARGS[4:]).digest() == FP.digest()
    others = [
        Fingerprint(*(FP_ARGS[:i] + (value,) + FP_ARGS[i + 1 :]))
        for i, value in enumerate(("other", "bfloat16", "q8_0", "bfloat16", 8, 3, 4, 16))
    ]
    assert len({f.digest() for f in others} | {FP.digest()}) == len(others) + 1
    assert FP.block_bytes == 2 * 2 * 4 * 2 * 8 * 4
    cache = torch.zeros(30, 2, 5, 64, 3, 64, dtype=torch.bfloat16)
    smol = Fingerprint.for_cache(cache, "smollm2", "bfloat16")
    assert smol.block_shape == tuple(cache[:, :, 0].shape) and smol.kv_dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown KV dtype"):
        Fingerprint(*FP_ARGS[:3], "float33", *FP_ARGS[4:])
    with pytest.raises(ValueError, match="positive int"):
        Fingerprint(*FP_ARGS[:4], 0, *FP_ARGS[5:])
    with pytest.raises(ValueError):
        Fingerprint.from_bytes(b"\x93garbage")


# -- disk tier: round trips, eviction, bounds ------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_disk_round_trip_is_bit_exact_between_cache_views(tmp_path, dtype):
    fp = Fingerprint(*FP_ARGS[:3], dtype, *FP_ARGS[4:])
    torch_dtype = fp.torch_kv_dtype
    cache = torch.randn(2, 2, 6, 4, 2, 8).to(torch_dtype)  # [layers, 2, blocks, ...]
    cache[0, 0, 3, 0, 0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -1e-40])
    with DiskTier(tmp_path, size_for(8, fp), fp) as tier:
        assert tier.store(11, tokens_of(11, fp), cache[:, :, 3])  # a strided view
        restored = torch.zeros_like(cache)
        assert tier.load(11, tokens_of(11, fp), restored[:, :, 5])
        assert torch.equal(bits(restored[:, :, 5]), bits(cache[:, :, 3]))
        assert restored[:, :, :5].abs().sum() == 0  # nothing written beside the block
        contiguous = torch.empty(fp.block_shape, dtype=torch_dtype)
        assert tier.load(11, tokens_of(11, fp), contiguous)
        assert torch.equal(bits(contiguous), bits(cache[:, :, 3]))
        # A transposed view takes the staging path: still the logical (C-order) bytes.
        odd = torch.empty(fp.block_shape[::-1], dtype=torch_dtype).permute(4, 3, 2, 1, 0)
        assert tier.load(11, tokens_of(11, fp), odd)
        assert torch.equal(bits(odd.contiguous()), bits(cache[:, :, 3]))
        stats = tier.stats()
        assert (stats.stores, stats.hits, stats.bytes_read) == (1, 3, 3 * fp.block_bytes)


def test_disk_token_mismatch_is_a_miss_leaving_out_untouched(tmp_path):
    with DiskTier(tmp_path, size_for(4), FP) as tier:
        assert tier.store(1, tokens_of(1), block_of(1))
        out = blank()
        wrong = tokens_of(1)
        wrong[-1] += 1
        assert not tier.load(1, wrong, out)
        assert not tier.load(2, tokens_of(1), out)  # unknown hash
        assert torch.equal(out, blank())
        assert 1 in tier and 2 not in tier and len(tier) == 1
        assert tier.stats().misses == 2
        with pytest.raises(ValueError, match="full blocks"):
            tier.load(1, tokens_of(1)[:2], out)
        with pytest.raises(ValueError, match="one block"):
            tier.store(3, tokens_of(3), torch.zeros(2, 2, 4, 2, 9))


def test_disk_store_of_a_held_block_writes_nothing(tmp_path):
    with DiskTier(tmp_path, size_for(4), FP) as tier:
        assert tier.store(1, tokens_of(1), block_of(1))
        assert tier.store(1, tokens_of(1), block_of(1))
        stats = tier.stats()
        assert (stats.stores, stats.already_stored, stats.bytes_written) == (1, 1, FP.block_bytes)
        # The same hash for other tokens (a collision): the newest content serves it.
        assert tier.store(1, tokens_of(2), block_of(2))
        out = blank()
        assert tier.load(1, tokens_of(2), out) and torch.equal(out, block_of(2))
        assert not tier.load(1, tokens_of(1), out)
        assert len(tier) == 1


def test_disk_evicts_least_recently_used_and_stays_within_size(tmp_path):
    size = size_for(3) + SLOT - 1  # room for 3 slots and most of a fourth
    with DiskTier(tmp_path, size, FP) as tier:
        assert tier.capacity_bytes == 3 * FP.block_bytes
        for k in (1, 2, 3):
            assert tier.store(k, tokens_of(k), block_of(k))
        assert loads(tier, 1)  # 1 is now the most recently used; 2 the least
        assert tier.store(4, tokens_of(4), block_of(4))
        assert 2 not in tier and all(k in tier for k in (1, 3, 4))
        assert tier.store(5, tokens_of(5), block_of(5))  # then 3 goes
        assert 3 not in tier and loads(tier, 1) and loads(tier, 4) and loads(tier, 5)
        for k in range(10, 40):
            assert tier.store(k, tokens_of(k), block_of(k))
            assert os.path.getsize(tier.data_path) <= size
        assert len(tier) == 3 and tier.used_bytes == 3 * FP.block_bytes
        assert tier.stats().evictions == 2 + 30
        assert [k for k in range(10, 40) if loads(tier, k)] == [37, 38, 39]


def test_disk_too_small_for_one_block_is_unavailable(tmp_path):
    with pytest.raises(TierUnavailable, match=f"{tmp_path}.*holds no block"):
        DiskTier(tmp_path, FILE_HEADER_BYTES + SLOT - 1, FP)


# -- disk tier: restarts and damaged files -----------------------------------------------------


def test_disk_restart_finds_blocks_and_their_lru_order(tmp_path):
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        for k in (1, 2, 3):
            assert tier.store(k, tokens_of(k), block_of(k))
        assert loads(tier, 1)  # LRU order now 2, 3, 1
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        assert len(tier) == 3 and all(loads(tier, k) for k in (1, 2, 3))
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        # The loads above made the order 1, 2, 3: a new block evicts 1.
        assert tier.store(4, tokens_of(4), block_of(4))
        assert 1 not in tier and loads(tier, 4) and loads(tier, 2)
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        # Ticks keep rising across opens, so the order is 3, 4, 2: a new block evicts 3.
        assert tier.store(5, tokens_of(5), block_of(5))
        assert 3 not in tier and all(k in tier for k in (2, 4, 5))


def test_disk_reopened_smaller_shrinks_the_file(tmp_path):
    with DiskTier(tmp_path, size_for(6), FP) as tier:
        for k in range(6):
            assert tier.store(k, tokens_of(k), block_of(k))
        path = tier.data_path
    with DiskTier(tmp_path, size_for(2), FP) as tier:
        assert os.path.getsize(path) <= size_for(2)
        assert [k for k in range(6) if loads(tier, k)] == [0, 1]  # the slots that still fit
        assert tier.store(9, tokens_of(9), block_of(9)) and loads(tier, 9)


def test_disk_truncated_file_reads_as_misses_then_stores_again(tmp_path):
    with DiskTier(tmp_path, size_for(6), FP) as tier:
        for k in range(4):
            assert tier.store(k, tokens_of(k), block_of(k))
        path = tier.data_path
    os.truncate(path, size_for(2) + 100)  # inside slot 2's payload
    with DiskTier(tmp_path, size_for(6), FP) as tier:
        assert [k for k in range(4) if loads(tier, k)] == [0, 1]
        for k in range(4, 8):
            assert tier.store(k, tokens_of(k), block_of(k))
        assert all(loads(tier, k) for k in range(4, 8))
    os.truncate(path, 10)  # not even a header
    with DiskTier(tmp_path, size_for(6), FP) as tier:
        assert len(tier) == 0 and "truncated" in tier.stats().reset_reason
        assert tier.store(1, tokens_of(1), block_of(1)) and loads(tier, 1)


def test_disk_corrupted_payload_byte_is_a_miss_and_the_slot_reused(tmp_path):
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        for k in range(3):
            assert tier.store(k, tokens_of(k), block_of(k))
        path = tier.data_path
    with open(path, "r+b") as f:
        f.seek(FILE_HEADER_BYTES + SLOT + 100)  # slot 1's payload
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        assert 1 in tier  # the header is intact: only the payload check finds it
        out = blank()
        assert not tier.load(1, tokens_of(1), out)
        assert tier.stats().corrupt_dropped == 1 and 1 not in tier
        assert loads(tier, 0) and loads(tier, 2)
        assert tier.store(5, tokens_of(5), block_of(5)) and tier.stats().evictions == 0
        assert loads(tier, 5)
    with DiskTier(tmp_path, size_for(3), FP) as tier:  # a damaged header: found at open
        assert tier.stats().corrupt_dropped == 0 and len(tier) == 3
    with open(path, "r+b") as f:
        f.seek(FILE_HEADER_BYTES + FP.block_bytes + 10)  # slot 0's entry header
        f.write(b"\xff")
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        assert tier.stats().corrupt_dropped == 1 and 0 not in tier and len(tier) == 2


def test_disk_restart_after_a_hash_moved_serves_its_newest_content(tmp_path):
    """A hash stored again with other tokens goes to the lowest free slot; its old slot,
    still valid on disk until reused, must not win on the next open."""
    with DiskTier(tmp_path, size_for(4), FP) as tier:
        assert tier.store(1, tokens_of(1), block_of(1))  # slot 0
        assert tier.store(2, tokens_of(2), block_of(2))  # slot 1
        with open(tier.data_path, "r+b") as f:  # damage slot 0 so a load frees it
            f.seek(FILE_HEADER_BYTES)
            f.write(b"\xde\xad")
        assert not loads(tier, 1)
        assert tier.store(2, tokens_of(3), block_of(3))  # hash 2 moves to slot 0
    with DiskTier(tmp_path, size_for(4), FP) as tier:
        out = blank()
        assert tier.load(2, tokens_of(3), out) and torch.equal(out, block_of(3))
        assert not tier.load(2, tokens_of(2), out) and len(tier) == 1
        for k in (4, 5, 6):  # fill the other slots: none may land on hash 2's
            assert tier.store(k, tokens_of(k), block_of(k))
        assert tier.load(2, tokens_of(3), out) and torch.equal(out, block_of(3))
        assert all(loads(tier, k) for k in (4, 5, 6))


def test_disk_another_fingerprint_never_sees_the_blocks(tmp_path):
    other = Fingerprint("another-model", *FP_ARGS[1:])
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        assert tier.store(1, tokens_of(1), block_of(1))
        mine = tier.data_path
    with DiskTier(tmp_path, size_for(3), other) as tier:
        assert len(tier) == 0 and not loads(tier, 1, other)
        assert tier.store(2, tokens_of(2), block_of(2))
    assert len(list(tmp_path.glob("*.kvtier"))) == 2  # one file per fingerprint
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        assert loads(tier, 1) and 2 not in tier
    # A file passed off under another fingerprint's name: its header gives it away.
    os.replace(mine, tmp_path / file_name(other))
    with DiskTier(tmp_path, size_for(3), other) as tier:
        assert len(tier) == 0 and "fingerprint" in tier.stats().reset_reason
        assert not loads(tier, 1, other)
    small = Fingerprint(*FP_ARGS[:4], 2, *FP_ARGS[5:])  # another block size
    with DiskTier(tmp_path, size_for(3, small), small) as tier:
        assert len(tier) == 0


@pytest.mark.parametrize(
    "offset, value, reason",
    [(8, struct.pack("<I", 2), "newer format"), (0, b"NOTATIER", "bad magic")],
)
def test_disk_foreign_header_starts_afresh(tmp_path, offset, value, reason):
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        assert tier.store(1, tokens_of(1), block_of(1))
        path = tier.data_path
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(value)
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        assert len(tier) == 0 and not loads(tier, 1)
        stats = tier.stats()
        assert stats.resets == 1 and reason in stats.reset_reason
        assert tier.store(2, tokens_of(2), block_of(2)) and loads(tier, 2)


# -- disk tier: unusable paths, failing writes ----------------------------------------------


def test_disk_unusable_path_is_unavailable_at_open(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    target = afile / "sub"
    with pytest.raises(TierUnavailable) as caught:  # fails as root too
        DiskTier(target, size_for(3), FP)
    assert str(target) in str(caught.value) and "Not a directory" in str(caught.value)
    with pytest.raises(TierUnavailable, match="File exists|Not a directory"):
        DiskTier(afile, size_for(3), FP)  # the path itself a file


def test_disk_full_at_open_is_unavailable(tmp_path, monkeypatch):
    real = os.statvfs(tmp_path)

    class Full:
        f_bavail, f_frsize = 0, real.f_frsize

    monkeypatch.setattr(disk_module.os, "statvfs", lambda path: Full)
    with pytest.raises(TierUnavailable, match=f"no space.*{tmp_path}"):
        DiskTier(tmp_path, size_for(3), FP)
    monkeypatch.undo()
    with DiskTier(tmp_path, size_for(3), FP) as tier:  # the refused open left it usable
        assert tier.store(1, tokens_of(1), block_of(1))


def failing_write(code: int, from_offset: int = 0):
    real = disk_module.write_all

    def write_all(fd, buffers, offset):
        if offset >= from_offset:
            raise OSError(code, os.strerror(code))
        return real(fd, buffers, offset)

    return write_all


def test_disk_write_error_disables_the_tier_with_one_message(tmp_path, monkeypatch):
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        assert tier.store(1, tokens_of(1), block_of(1))
        monkeypatch.setattr(disk_module, "write_all", failing_write(errno.EIO))
        assert not tier.store(2, tokens_of(2), block_of(2))
        assert not tier.store(3, tokens_of(3), block_of(3))
        assert not loads(tier, 1)  # disabled: serves nothing more, raises nothing
        stats = tier.stats()
        assert "Input/output error" in stats.disabled and tier.data_path in stats.disabled
        assert stats.errors == 1
    monkeypatch.undo()
    with DiskTier(tmp_path, size_for(3), FP) as tier:  # what was stored before is intact
        assert loads(tier, 1)


def test_disk_full_later_caps_the_tier(tmp_path, monkeypatch):
    with DiskTier(tmp_path, size_for(8), FP) as tier:
        for k in range(2):
            assert tier.store(k, tokens_of(k), block_of(k))
        monkeypatch.setattr(disk_module, "write_all", failing_write(errno.ENOSPC, size_for(2)))
        assert not tier.store(2, tokens_of(2), block_of(2))
        stats = tier.stats()
        assert stats.disabled is None and "capped at 2 blocks" in stats.note
        assert tier.capacity_bytes == 2 * FP.block_bytes
        assert tier.store(3, tokens_of(3), block_of(3))  # evicts 0 instead of growing
        assert 0 not in tier and loads(tier, 1) and loads(tier, 3)


# -- disk tier: processes and torn writes ------------------------------------------------------

HOLD = """
import sys
from nanokv_cli.engine.tiers.disk import DiskTier
from nanokv_cli.engine.tiers.fingerprint import Fingerprint
from test_kv_tiers import FP
tier = DiskTier(sys.argv[1], int(sys.argv[2]), FP)
print("ready", flush=True)
sys.stdin.read()
"""


def test_disk_second_process_is_refused_naming_the_holder(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path), str(size_for(3))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(TierUnavailable, match=f"in use by process {child.pid}; refused"):
            DiskTier(tmp_path, size_for(3), FP)
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    with DiskTier(tmp_path, size_for(3), FP) as tier:  # the lock left with the process
        with pytest.raises(TierUnavailable, match=f"process {os.getpid()}"):
            DiskTier(tmp_path, size_for(3), FP)  # one owner within a process too
        assert tier.store(1, tokens_of(1), block_of(1))


def test_disk_store_interrupted_mid_write_leaves_a_miss(tmp_path, monkeypatch):
    """Ctrl-C inside a write: half the payload on disk, no header; the process dies."""
    real = disk_module.write_all

    def torn(fd, buffers, offset):
        half = b"".join(bytes(b) for b in buffers)[: FP.block_bytes // 2]
        real(fd, [memoryview(half)], offset)
        raise KeyboardInterrupt

    tier = DiskTier(tmp_path, size_for(3), FP)
    for k in range(3):
        assert tier.store(k, tokens_of(k), block_of(k))
    monkeypatch.setattr(disk_module, "write_all", torn)
    with pytest.raises(KeyboardInterrupt):
        tier.store(3, tokens_of(3), block_of(3))  # evicts 0 and tears its slot
    monkeypatch.undo()
    assert len(tier) == 2 and tier.store(4, tokens_of(4), block_of(4))  # slot not lost
    tier.close()
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        assert [k for k in range(5) if loads(tier, k)] == [1, 2, 4]
    monkeypatch.setattr(disk_module, "write_all", torn)
    tier = DiskTier(tmp_path, size_for(3), FP)
    with pytest.raises(KeyboardInterrupt):
        tier.store(5, tokens_of(5), block_of(5))
    tier.close()
    monkeypatch.undo()
    with DiskTier(tmp_path, size_for(3), FP) as tier:
        # 1 was the least recently used (loaded first above): its slot was the one torn.
        assert [k for k in range(6) if loads(tier, k)] == [2, 4]
        assert tier.stats().corrupt_dropped == 0  # its header was zeroed first: empty


CHURN = """
import sys
from nanokv_cli.engine.tiers.disk import DiskTier
from test_kv_tiers import BIG, CHURN_BLOCKS, block_of, tokens_of
tier = DiskTier(sys.argv[1], int(sys.argv[2]), BIG)
# Made up front, so the loop spends its time in store and a kill lands inside writes.
blocks = [block_of(k, BIG) for k in range(CHURN_BLOCKS)]
k = 0
while True:
    # 16 hashes, each stored again and again with new tokens: every store writes a slot.
    assert tier.store(k % 16, tokens_of(k, BIG), blocks[k % CHURN_BLOCKS])
    print(k, flush=True)
    k += 1
"""
CHURN_BLOCKS = 37  # prime to 16: a hash's next content differs from its last


def test_disk_process_killed_mid_store_loses_at_most_that_block(tmp_path):
    size = size_for(24, BIG)
    child = subprocess.Popen(
        [sys.executable, "-c", CHURN, str(tmp_path), str(size)],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    done = []
    try:
        for line in child.stdout:
            done.append(int(line))
            if done[-1] >= 200:
                break
        time.sleep(0.0013)
    finally:
        child.send_signal(signal.SIGKILL)
    done += [int(line) for line in child.stdout]
    child.wait(timeout=60)
    last = max(done)
    with DiskTier(tmp_path, size, BIG) as tier:
        restored = 0
        for h in range(16):
            last_done = max(k for k in range(last + 1) if k % 16 == h)
            out = blank(BIG)
            # The block completed last under h, or the one in flight when the kill came.
            for k in (last_done + 16, last_done):
                if tier.load(h, tokens_of(k, BIG), out):
                    expected = block_of(k % CHURN_BLOCKS, BIG)
                    assert torch.equal(out, expected), f"hash {h}: wrong K/V"
                    restored += 1
                    break
        assert restored >= 15


# -- host tier and opening by spec -----------------------------------------------------------


def test_host_tier_round_trip_lru_and_misses():
    with HostTier(3 * FP.block_bytes + 5, FP, pin=True) as tier:
        assert not tier.pin or torch.cuda.is_available()
        cache = torch.randn(2, 2, 4, 4, 2, 8)
        assert tier.store(1, tokens_of(1), cache[:, :, 2])
        cache[:, :, 2] = 0  # the tier holds a copy, not a view
        out = blank()
        assert not tier.load(1, tokens_of(2), out) and torch.equal(out, blank())
        for k in (2, 3):
            assert tier.store(k, tokens_of(k), block_of(k))
        assert tier.load(1, tokens_of(1), out) and out.abs().sum() > 0
        assert tier.store(4, tokens_of(4), block_of(4))  # evicts 2, the least recent
        assert 2 not in tier and loads(tier, 3) and loads(tier, 4) and len(tier) == 3
        stats = tier.stats()
        assert (stats.evictions, stats.misses, tier.used_bytes) == (1, 1, tier.capacity_bytes)
    assert not tier.store(5, tokens_of(5), block_of(5)) and len(tier) == 0
    with pytest.raises(TierUnavailable, match="holds no block"):
        HostTier(FP.block_bytes - 1, FP)


def test_host_tier_bfloat16_is_bit_exact():
    fp = Fingerprint(*FP_ARGS[:3], "bfloat16", *FP_ARGS[4:])
    tier = HostTier(1 << 20, fp, pin=False)
    assert tier.store(7, tokens_of(7, fp), block_of(7, fp)) and loads(tier, 7, fp)


def test_open_tier_opens_what_the_spec_names(tmp_path):
    disk = open_tier(f"disk:{tmp_path}:{size_for(3)}", FP)
    host = open_tier(parse_tier("host:1MiB"), FP, pin=False)
    try:
        assert isinstance(disk, DiskTier) and isinstance(host, HostTier)
        for tier in (disk, host):
            assert isinstance(tier, Tier)
            assert tier.store(1, tokens_of(1), block_of(1)) and loads(tier, 1)
    finally:
        disk.close()
        host.close()
    with pytest.raises(TierUnavailable):
        open_tier("host:100", FP)


def test_tiers_import_only_the_stdlib_and_their_few_libraries():
    """The tiers stand alone (the engine imports them, never the other way): no import of the
    rest of nanokv_cli, and of libraries only numpy, torch, xxhash and msgpack (no UI or web)."""
    allowed = {"numpy", "torch", "xxhash", "msgpack"} | set(sys.stdlib_module_names)
    folder = ROOT / "nanokv_cli" / "engine" / "tiers"
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{path.name} reaches outside the tiers: {node.module}"
                continue
            if isinstance(node, ast.ImportFrom):
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_a_restored_block_stored_again_before_its_write_stores_what_was_restored():
    """A restored block's K/V wait in a buffer until the runner writes them before the next
    forward pass. Evicted into the tier before that (the sequence freed it, the tier had let
    its copy go), it must store the buffer's K/V, not what the cache slot still holds."""
    tier = HostTier(FP.block_bytes, FP, pin=False)  # room for one block
    layers, _, bs, heads, dim = FP.block_shape
    cache = torch.full((layers, 2, 3, bs, heads, dim), float("nan"))  # 3 blocks, unwritten
    backend = ModelTier(tier, cache, bandwidth=1e9)
    assert tier.store(11, tokens_of(1), block_of(1))
    handle = backend.fetch(11, tokens_of(1))
    backend.place(0, handle)  # restored into block 0, not yet written
    assert tier.store(22, tokens_of(2), block_of(2)) and 11 not in tier  # the tier let it go
    assert backend.save(0, 11, tokens_of(1))
    out = torch.empty(FP.block_shape, dtype=FP.torch_kv_dtype)
    assert tier.load(11, tokens_of(1), out)
    assert torch.equal(bits(out), bits(block_of(1)))
    backend.apply()  # and the write still lands
    assert torch.equal(bits(cache[:, :, 0]), bits(block_of(1)))
    assert cache[:, :, 1:].isnan().all()
