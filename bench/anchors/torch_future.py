"""bench/anchors/torch_future.py — the peer from Python: torch.futures.Future
with devices=["cuda:0"], on the same work as bench/bench_future.c, including
what libtorch's C++ future cannot look inside: user objects each holding a
tensor (PyTorch extracts their tensors by pickling). Prints bench.json rows."""
import json
import time

import torch


class Activation:
    def __init__(self, data):
        self.data = data


def best_of(rounds, k, setup, op):
    best = 1e9
    for _ in range(rounds):
        state = setup()
        t0 = time.perf_counter()
        for i in range(k):
            op(state, i)
        best = min(best, (time.perf_counter() - t0) / k * 1e6)
    return best


def row(name, us):
    print(json.dumps({"name": name, "backend": "cuda", "value": round(us, 4), "unit": "us", "ratio": 1.0,
                      "ratio_vs": "torch.futures.Future(devices=['cuda:0']) from Python (anchor)"}), flush=True)


def main():
    dev = torch.device("cuda:0")
    for kind in ("list", "nested", "objects"):
        for n in (1, 10, 100, 1000, 10000, 100000):
            ts = [torch.empty(256, device=dev) for _ in range(n)]
            if kind == "list":
                value = ts
            elif kind == "nested":
                value = [(t, [t[128:]]) for t in ts]
            else:
                value = [Activation(t) for t in ts]
            k = 20 if n >= 1000 else 200 if n >= 100 else 1000
            if n >= 10000:
                k = 5 if n == 10000 else 2
            if kind == "objects" and n == 100000:
                k = 1
            us = best_of(3, k, lambda: [torch.futures.Future(devices=["cuda:0"]) for _ in range(k)],
                         lambda fs, i: fs[i].set_result(value))
            row(f"torch_py_future_complete_{kind}_{n}", us)
            torch.cuda.synchronize()
    done = torch.futures.Future(devices=["cuda:0"])
    done.set_result([torch.empty(256, device=dev)])
    row("torch_py_future_then_hop", best_of(3, 1000, lambda: None, lambda s, i: done.then(lambda f: f.value())))
    row("torch_py_future_wait", best_of(3, 1000, lambda: None, lambda s, i: done.wait()))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
