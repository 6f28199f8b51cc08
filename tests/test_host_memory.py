"""`host_memory.keep_freed_blocks`: a large block freed and allocated again is reused, not faulted in afresh."""

import json
import subprocess
import sys

import pytest


# Page faults (minor: the kernel maps and zeroes a page) of allocating and filling a 256 MiB tensor after freeing a
# 260 MiB one, in a fresh process, with and without `keep_freed_blocks()` (it changes the whole process). The freed
# block is the larger: torch's aligned allocations ask malloc for a little more than their size.
SCRIPT = """
import json, resource, sys
import torch
from hf_elmo.host_memory import keep_freed_blocks

kept = keep_freed_blocks() if sys.argv[1] == "keep" else None
def faults_of_a_fresh_block(mib):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(mib * 2**18)  # written
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del block
    return faults
first, again = faults_of_a_fresh_block(260), faults_of_a_fresh_block(256)
print(json.dumps({"kept": kept, "first": first, "again": again}))
"""


def faults(mode: str) -> dict:
    result = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_freed_large_block_is_reused_without_page_faults():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc only")
    plain, kept = faults("plain"), faults("keep")
    if kept["kept"] is False:
        pytest.skip("this Linux does not run on glibc (its malloc takes no mallopt settings)")
    assert kept["kept"] is True
    # Without it, glibc maps every such block afresh: faulted in again (4 KiB pages; fewer with huge pages).
    assert plain["again"] >= 100 and plain["first"] >= 100
    # With it, the second block is the first one's memory.
    assert kept["first"] >= 100 and kept["again"] <= plain["again"] // 20
