"""Block hashes: deterministic across processes, chained, separated by adapter and salt."""

import subprocess
import sys

from services.common.block_hash import ROOT, extra_keys, hash_block, hash_blocks


def test_same_in_another_process():
    code = ("from services.common.block_hash import hash_blocks, extra_keys;"
            "print(hash_blocks(list(range(64)), 16, extra_keys('a', 's'))[-1].hex())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == hash_blocks(list(range(64)), 16, extra_keys("a", "s"))[-1].hex()


def test_chain_depends_on_the_whole_prefix():
    a = hash_blocks([1] * 16 + [2] * 16, 16)
    b = hash_blocks([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]
    assert hash_blocks([1] * 16, 16) == a[:1]


def test_extra_keys_separate_tenants_and_adapters():
    tokens = list(range(16))
    plain = hash_block(ROOT, tokens)
    assert hash_block(ROOT, tokens, extra_keys(salt="tenant-a")) != hash_block(ROOT, tokens,
                                                                               extra_keys(salt="tenant-b"))
    assert hash_block(ROOT, tokens, extra_keys(adapter="x")) != plain
    assert hash_block(ROOT, tokens, extra_keys()) == hash_block(ROOT, tokens, extra_keys("", ""))


def test_partial_blocks_are_not_hashed():
    assert len(hash_blocks(list(range(40)), 16)) == 2


def test_no_torch_import():
    code = "import sys, services.common.block_hash, services.policy.arbitration; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
