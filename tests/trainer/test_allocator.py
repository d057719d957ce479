"""keep_freed_memory: a freed large buffer is reused without page faults (in a child process, so
the test process keeps glibc's defaults)."""

import platform
import subprocess
import sys

import pytest

# Page faults of allocating, filling and freeing 64 MB, before and after keep_freed_memory().
FAULTS_SCRIPT = """
import ctypes, resource
from trainer.allocator import keep_freed_memory
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = libc.malloc(64 << 20)
    libc.memset(buffer, 1, 64 << 20)
    libc.free(buffer)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults()
default = faults()
applied = keep_freed_memory()
faults()
print(applied, default, faults())
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only; a no-op elsewhere")
def test_freed_buffers_are_reused_without_page_faults():
    result = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT], capture_output=True, text=True, timeout=30, check=True)
    applied, default, kept = result.stdout.split()
    assert applied == "True"
    assert int(default) > 1000  # glibc's default: 64 MB mapped and faulted in anew
    assert int(kept) < int(default) // 100
