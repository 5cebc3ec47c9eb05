"""Python binding benchmarks: devpickle against PyTorch on the same objects,
in the same process. Appends rows to build/bench.json (ratio = devpickle's
time / PyTorch's: below 1 is faster).

    PYTHONPATH=build/python python3 bench/py_bench.py build/bench.json [--quick]

Rows:
  py_scan_*                   devpickle.scan(obj, paths=False) vs
                              torch._jit_internal._extract_tensors(obj)
  py_future_set_result_*      devpickle.Future().set_result(obj) vs
                              torch.futures.Future(devices=["cuda:0"]).set_result(obj)
                              (on a machine without CUDA: vs _extract_tensors +
                              torch.futures.Future().set_result, the work torch's
                              CUDA future does at set_result less its events)
  py_then_hop                 one link of a 1,000-link then() chain, completed
                              by set_result, vs torch.futures.Future
  py_dumps_* / py_loads_*     devpickle.dumps(obj, buffer_callback=...) and
                              devpickle.loads(frame, buffers=...) vs pickle
                              (protocol 5, buffer_callback / buffers= too) on a
                              list of 1,000 tensors (torch: pickle carries their
                              bytes in band, torch's reduce) and of 1,000 numpy
                              arrays (out of band on both sides)
Each figure is the median of repeated runs (each run timed over enough calls);
the two sides of a row run in turns, one run of each a pair, and the ratio is
the median of the pairs' ratios: a host whose speed drifts during the bench
(other tenants, clock) moves both sides of a pair alike.
"""

import dataclasses
import json
import statistics
import sys
import threading
import time

import torch
from torch._jit_internal import _extract_tensors

import devpickle

CUDA = torch.cuda.is_available()
DEV = "cuda:0" if CUDA else "cpu"
BACKEND = "cuda" if CUDA else "cpu"


class User:
    def __init__(self, t):
        self.t = t


@dataclasses.dataclass
class Rec:
    t: object
    step: int = 0


def calls_per_run(fn, min_time, repeats):
    """How many calls of fn make one run last min_time / repeats."""
    fn()
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_time / repeats or n >= 1 << 20:
            return n
        n *= 2


def one_run(fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def paired_time(ours, theirs, min_time=0.05, repeats=7):
    """(our median, their median, median of the runs' ratios): a run of each
    in turn, `repeats` pairs."""
    n, m = calls_per_run(ours, min_time, repeats), calls_per_run(theirs, min_time, repeats)
    a, b = [], []
    for _ in range(repeats):
        a.append(one_run(ours, n))
        b.append(one_run(theirs, m))
    return statistics.median(a), statistics.median(b), statistics.median(x / y for x, y in zip(a, b))


def values(quick):
    ts = [torch.ones(4, device=DEV) for _ in range(1000)]
    big = torch.ones(256, device=DEV)
    tree_leaves = 100_000 if quick else 1_000_000
    tensors_in_tree = 10_000

    def tree():
        # lists of 10 down to leaves: ints, every 100th a tensor view
        leaves = [big[i % 256:] if i % (tree_leaves // tensors_in_tree) == 0 else i for i in range(tree_leaves)]
        level = leaves
        while len(level) > 1:
            level = [level[i:i + 10] for i in range(0, len(level), 10)]
        return level[0]

    return {
        "list_1000": ts,
        "nested_1000": [(t, [t[:2]]) for t in ts],
        "objects_1000": [User(t) for t in ts],
        "dataclass_1000": [Rec(t, i) for i, t in enumerate(ts)],
        "big_bytes": {"t": ts[0], "blob": b"x" * (100 << 20)},
        ("tree_1m" if not quick else "tree_100k"): tree(),
    }


def row(out, name, timed, vs, per=1):
    """timed: paired_time's answer; per: calls of the timed functions a figure is."""
    value_s, base_s, ratio = timed[0] / per, timed[1] / per, timed[2]
    r = {"name": name, "backend": BACKEND, "value": round(value_s * 1e6, 3), "unit": "us",
         "ratio": round(ratio, 4), "ratio_vs": vs, "baseline_us": round(base_s * 1e6, 3)}
    out.write(json.dumps(r) + "\n")
    print(f"{name:34s} {BACKEND:5s} {value_s * 1e6:12.2f} us   ratio {ratio:8.4f} vs {vs} ({base_s * 1e6:.2f} us)")


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "build/bench.json"
    quick = "--quick" in sys.argv
    vals = values(quick)
    adapter = devpickle._devpickle._torch_adapter()
    print(f"devpickle reads torch tensors through: {adapter}; torch {torch.__version__}, device {DEV}")
    with open(path, "a") as out:
        for name, v in vals.items():
            timed = paired_time(lambda: devpickle.scan(v, paths=False), lambda: _extract_tensors(v))
            row(out, f"py_scan_{name}", timed, "torch._jit_internal._extract_tensors")
        # opaque= of types whose metaclass is type (a lock, a text file),
        # against the same scan without: answered once per type a walk, they
        # should cost about nothing (ratio near 1)
        opaque = (type(threading.Lock()), type(sys.stdout))
        for name in ("list_1000", "objects_1000"):
            v = vals[name]
            timed = paired_time(lambda: devpickle.scan(v, paths=False, opaque=opaque),
                                lambda: devpickle.scan(v, paths=False))
            row(out, f"py_scan_opaque_{name}", timed, "devpickle.scan without opaque=")
        for name in ("list_1000", "objects_1000", "dataclass_1000", "big_bytes", "nested_1000"):
            v = vals[name]
            if CUDA:
                def theirs_fn():
                    torch.futures.Future(devices=[DEV]).set_result(v)
                vs = 'torch.futures.Future(devices=["cuda:0"]).set_result'
            else:
                def theirs_fn():
                    _extract_tensors(v)
                    torch.futures.Future().set_result(v)
                vs = "_extract_tensors + torch.futures.Future().set_result (no CUDA here)"
            timed = paired_time(lambda: devpickle.Future().set_result(v), theirs_fn)
            row(out, f"py_future_set_result_{name}", timed, vs)

        def chain(fut_cls, devices):
            f = fut_cls(devices=devices) if devices is not None else fut_cls()
            tail = f
            for _ in range(1000):
                tail = tail.then(lambda fut: fut.value())
            f.set_result(1)
            tail.wait()

        import pickle

        np = __import__("numpy")
        for name, v in (("list_1000", vals["list_1000"]), ("numpy_1000", [np.ones(4) for _ in range(1000)])):
            bufs, pbufs = [], []
            frame = devpickle.dumps(v, buffer_callback=bufs.append)
            pframe = pickle.dumps(v, protocol=5, buffer_callback=pbufs.append)
            timed = paired_time(lambda: devpickle.dumps(v, buffer_callback=[].append),
                                lambda: pickle.dumps(v, protocol=5, buffer_callback=[].append))
            row(out, f"py_dumps_{name}", timed, "pickle.dumps(protocol=5, buffer_callback=)")
            timed = paired_time(lambda: devpickle.loads(frame, buffers=bufs),
                                lambda: pickle.loads(pframe, buffers=pbufs))
            row(out, f"py_loads_{name}", timed, "pickle.loads(buffers=)")

        timed = paired_time(lambda: chain(devpickle.Future, None),
                            lambda: chain(torch.futures.Future, [DEV] if CUDA else None), min_time=0.5)
        row(out, "py_then_hop", timed, "torch.futures.Future then() hop" + (" (devices=[cuda:0])" if CUDA else ""),
            per=1000)


if __name__ == "__main__":
    main()
