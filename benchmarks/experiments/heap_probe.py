"""Run a method script with a heap probe beside it: is growing resident memory a leak or allocator retention?

    python -m benchmarks.experiments.heap_probe grpo_aent.py [flags]   (soak.py --heap-probe launches it this way)

A daemon thread wakes every $HEAP_PROBE_INTERVAL seconds (default 20) and appends one line to $HEAP_PROBE_OUT
(default heap_probe_rank<r>.jsonl): the live torch tensors (count and bytes of their storages), the number of objects
the garbage collector tracks and the types whose count grew most since the first sample, this process's RSS and
anonymous RSS, the bytes glibc's malloc holds (mallinfo2: in use vs free inside the heap); then it calls
malloc_trim(0) and records the RSS again. A leak keeps growing in live objects, tensors or malloc's in-use bytes;
memory that malloc frees but keeps (fragmentation) shows as free bytes and goes back to the system under malloc_trim,
so the trimmed RSS stays flat.
"""

import ctypes
import gc
import json
import os
import runpy
import sys
import threading
import time
import warnings
from collections import Counter


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def proc_status() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "anon_mb": int(fields["RssAnon"].split()[0]) / 1024}


def tensor_census() -> tuple:
    import torch

    count, storages = 0, {}
    with warnings.catch_warnings():  # isinstance() on some torch module attributes warns of their deprecation
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        try:
            if obj.device.type == "cpu":
                count += 1
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except Exception:  # half-built objects, meta tensors
            pass
    return count, sum(storages.values()) / 2**20


def probe(out: str, interval: float) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    baseline = None
    while True:
        time.sleep(interval)
        tensors, tensor_mb = tensor_census()
        objects = gc.get_objects()
        counts = Counter(type(o).__qualname__ for o in objects)
        baseline = baseline or counts  # the types whose number of live objects grew most since the first sample
        row = {
            "time": round(time.time(), 1),
            "gc_objects": len(objects),
            "tensors": tensors,
            "tensor_mb": round(tensor_mb, 1),
            "grown_types": dict((counts - baseline).most_common(8)),
        }
        del objects, counts
        info = libc.mallinfo2()  # read after the census, so that RSS before and after the trim differ by the trim alone
        row.update(
            proc_status(),
            malloc_in_use_mb=(info.uordblks + info.hblkhd) / 2**20,
            malloc_free_mb=info.fordblks / 2**20,
            mmapped_mb=info.hblkhd / 2**20,
        )
        t = time.perf_counter()
        libc.malloc_trim(0)
        row["trim_ms"] = round(1000 * (time.perf_counter() - t), 2)
        row["rss_after_trim_mb"] = proc_status()["rss_mb"]
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    script, sys.argv = sys.argv[1], sys.argv[1:]
    rank = os.environ.get("RANK", "0")
    out = os.environ.get("HEAP_PROBE_OUT", f"heap_probe_rank{rank}.jsonl").replace("{rank}", rank)
    threading.Thread(target=probe, args=(out, float(os.environ.get("HEAP_PROBE_INTERVAL", "20"))), daemon=True).start()
    # no sys.path entry for the script's folder: the method scripts sit at the repository root, which `python -m` from
    # the root already puts first on sys.path
    runpy.run_path(script, run_name="__main__")
