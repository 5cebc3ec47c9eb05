// bench/anchors/torch_future.cpp — the peer on the same work: libtorch's
// c10::ivalue::Future with devices = {cuda:0}, from C++. Built and run on the
// GPU machine, where PyTorch is installed (bench/anchors/run.sh).
// Prints one JSON object a line, as build/bench.json rows.
#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/ivalue_inl.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
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

// T threads, each repeatedly building a list of 100 tensors, completing a
// future with it, waiting and releasing it: the same work as
// bench_future's threads rows. Tensors are made once per thread (their
// allocation is the caching allocator's, not the future's, cost).
static void threads(const at::TensorOptions &opts, const std::vector<c10::Device> &devices) {
  const int iters = 2000;
  double one = 0;
  for (int T : {1, 4, 16}) {
    double best = 1e18;
    for (int r = 0; r < 3; r++) {
      std::atomic<int> ready{0};
      std::vector<std::thread> th;
      auto t0 = clk::now();
      for (int t = 0; t < T; t++)
        th.emplace_back([&] {
          std::vector<at::Tensor> ts;
          for (int i = 0; i < 100; i++) ts.push_back(at::empty({256}, opts));
          ready++;
          for (int it = 0; it < iters; it++) {
            c10::impl::GenericList list(c10::AnyType::get());
            for (auto &x : ts) list.push_back(x);
            auto f = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get(), devices);
            f->markCompleted(c10::IValue(list));
            f->wait();
          }
        });
      for (auto &x : th) x.join();
      double us = std::chrono::duration<double, std::micro>(clk::now() - t0).count();
      best = std::min(best, us);
    }
    // throughput: completions per microsecond, all threads together
    double rate = (double)T * iters / best;
    if (T == 1) one = rate;
    printf("{\"name\": \"torch_future_threads_list100_t%d\", \"backend\": \"cuda\", \"value\": %.4g, "
           "\"unit\": \"completions/us\", \"ratio\": %.4g, \"ratio_vs\": \"the same with 1 thread (scaling)\"}\n",
           T, rate, rate / one);
    fflush(stdout);
  }
}

int main() {
  c10::Device dev(c10::kCUDA, 0);
  std::vector<c10::Device> devices = {dev};
  auto opts = at::TensorOptions().device(dev).dtype(at::kFloat);
  const int sizes[] = {1, 10, 100, 1000, 10000, 100000};
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
      int k = n >= 100000 ? 3 : n >= 10000 ? 10 : n >= 1000 ? 20 : n >= 100 ? 200 : 1000;
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
  threads(opts, devices);
  return 0;
}
