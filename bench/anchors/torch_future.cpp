// bench/anchors/torch_future.cpp — the peer on the same work: libtorch's
// c10::ivalue::Future with devices = {cuda:0}, from C++. Built and run on the
// GPU machine, where PyTorch is installed (bench/anchors/run.sh).
// Prints one JSON object a line, as build/bench.json rows.
#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

using clk = std::chrono::steady_clock;

static double best_of(int rounds, int k, const std::function<void()> &setup, const std::function<void()> &op) {
  double best = 1e9;
  for (int r = 0; r < rounds; r++) {
    setup();
    auto t0 = clk::now();
    for (int i = 0; i < k; i++) op();
    double us = std::chrono::duration<double, std::micro>(clk::now() - t0).count() / k;
    best = std::min(best, us);
  }
  return best;
}

static void row(const char *name, double us) {
  printf("{\"name\": \"%s\", \"backend\": \"cuda\", \"value\": %.4g, \"unit\": \"us\", \"ratio\": 1.0, "
         "\"ratio_vs\": \"libtorch c10::ivalue::Future (anchor)\"}\n", name, us);
  fflush(stdout);
}

int main() {
  c10::Device dev(c10::kCUDA, 0);
  std::vector<c10::Device> devices = {dev};
  auto opts = at::TensorOptions().device(dev).dtype(at::kFloat);
  const int sizes[] = {1, 10, 100, 1000, 10000};
  for (int kind = 0; kind < 2; kind++) {
    for (int n : sizes) {
      c10::impl::GenericList list(c10::AnyType::get());
      for (int i = 0; i < n; i++) {
        at::Tensor t = at::empty({256}, opts);
        if (kind == 0) {
          list.push_back(t);
        } else {
          c10::List<at::Tensor> inner;
          inner.push_back(t.narrow(0, 128, 128));
          list.push_back(c10::ivalue::Tuple::create({t, inner}));
        }
      }
      c10::IValue value(list);
      int k = n >= 1000 ? 20 : n >= 100 ? 200 : 1000;
      std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futs(k);
      double us = best_of(
          5, k,
          [&] {
            for (auto &f : futs) f = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get(), devices);
          },
          [&, i = 0]() mutable { futs[i++ % k]->markCompleted(value); });
      char name[64];
      snprintf(name, sizeof name, "torch_future_complete_%s_%d", kind == 0 ? "list" : "nested", n);
      row(name, us);
      c10::cuda::device_synchronize();
    }
  }
  // one then() hop on a completed future holding one tensor, and a wait
  c10::impl::GenericList one(c10::AnyType::get());
  one.push_back(at::empty({256}, opts));
  auto done = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get(), devices);
  done->markCompleted(c10::IValue(one));
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> kids(1000);
  double hop = best_of(5, 1000, [] {}, [&, i = 0]() mutable {
    kids[i++ % 1000] = done->then([](c10::ivalue::Future &f) { return f.value(); }, c10::AnyType::get());
  });
  row("torch_future_then_hop", hop);
  double wait = best_of(5, 1000, [] {}, [&] { done->wait(); });
  row("torch_future_wait", wait);
  c10::cuda::device_synchronize();
  return 0;
}
