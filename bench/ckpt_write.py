"""Where a large checkpoint's commit and resume check go: DCP's synchronous write (fsynced) of a
CPU state with FileSystemWriter's thread_count 1, 2, 4, 8; the CRC-32 pass over the files written
(what the manifest costs when it is computed by reading the files back); and resume's check of
the committed folder (`ett.checkpoints.folders.verify`) reading one file at a time against VERIFY_THREADS at
once. The files are still in the page cache, as after a restart on the same node.

    python bench/ckpt_write.py [--gib 4] [--dir /tmp/ett-ckpt-write]
"""

import argparse
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ett import folders
from ett.checkpoints.tiers import file_crc32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4)
    parser.add_argument("--dir", default="/tmp/ett-ckpt-write")
    parser.add_argument("--threads", default="1,2,4,8")
    args = parser.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    n_tensors = 32
    numel = int(args.gib * 2**30 / 4 / n_tensors)
    state = {f"t{i}": torch.randn(numel) for i in range(n_tensors)}
    nbytes = n_tensors * numel * 4
    root = Path(args.dir)
    for threads in (int(t) for t in args.threads.split(",")):
        shutil.rmtree(root, ignore_errors=True)
        start = time.perf_counter()
        dcp.save(state, storage_writer=FileSystemWriter(root, sync_files=True, thread_count=threads))
        write = time.perf_counter() - start
        start = time.perf_counter()
        for path in root.glob("*.distcp"):
            file_crc32(path)
        crc = time.perf_counter() - start
        folders.write_marker(root, 1, 1, folders.folder_manifest(root))
        verify_s = {}
        for verify_threads in (1, folders.VERIFY_THREADS):
            folders.VERIFY_THREADS = verify_threads
            start = time.perf_counter()
            assert folders.verify(root) is None
            verify_s[verify_threads] = time.perf_counter() - start
        print(f"  thread_count {threads}: write+fsync {write:.2f} s ({nbytes / write / 2**30:.2f} GiB/s), "
              f"CRC-32 pass {crc:.2f} s ({nbytes / crc / 2**30:.2f} GiB/s), verify "
              + ", ".join(f"{s:.2f} s with {t} thread(s)" for t, s in verify_s.items()), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
