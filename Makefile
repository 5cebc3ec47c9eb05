# devpickle — GNU make build. `make help` lists the targets.

PREFIX    ?= /usr/local
DESTDIR   ?=
CC        ?= cc
BUILD     ?= build
STAMPS     = $(BUILD)/stamp
CUDA_HOME ?= /usr/local/cuda

# The version is written once, in include/devpickle/base.h; read it from there.
VERSION_PART = $(shell sed -n 's/^.define DP_VERSION_$(1) *\([0-9][0-9]*\).*/\1/p' include/devpickle/base.h)
VERSION   := $(call VERSION_PART,MAJOR).$(call VERSION_PART,MINOR).$(call VERSION_PART,PATCH)
SONAME    := libdevpickle.so.$(call VERSION_PART,MAJOR)
WARN      := -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -Wmissing-prototypes
OPT       ?= -O2 -g
CFLAGS    ?=
DPFLAGS   := -std=c11 -D_POSIX_C_SOURCE=200809L $(WARN) $(OPT) -Iinclude -fPIC -fvisibility=hidden -DDP_BUILDING
TFLAGS    := -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -Wextra -Werror $(OPT) -Iinclude -Itest
SANFLAGS  ?=

# CUDA: the backend is built whenever the toolkit is present; the runtime is
# linked statically, so binaries need no libcudart at run time (only a driver).
HAVE_CUDA := $(if $(wildcard $(CUDA_HOME)/include/cuda_runtime_api.h),1,0)
ifeq ($(HAVE_CUDA),1)
CUDA_CFLAGS := -DDP_HAVE_CUDA -isystem $(CUDA_HOME)/include
CUDA_LIBS   := -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt
endif
# UCX (the transport) is linked --as-needed: a link that pulls no transport
# object from libdevpickle.a (the Python binding) does not depend on it.
UCX_LIBS  := -Wl,--push-state,--as-needed -lucp -lucs -Wl,--pop-state
LDLIBS    := -lmsgpackc -lxxhash $(UCX_LIBS) $(CUDA_LIBS) -lpthread -lm
NVCC      ?= $(CUDA_HOME)/bin/nvcc
GPU_ARCH  ?= -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90

LIB_SRC   := $(wildcard core/*.c value/*.c pickler/*.c device/*.c cache/*.c future/*.c transport/*.c)
LIB_OBJ   := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
CLI_SRC   := $(wildcard tools/*.c)
CLI_OBJ   := $(CLI_SRC:%.c=$(BUILD)/obj/%.o)
TEST_SRC  := $(wildcard test/test_*.c)
TEST_BIN  := $(TEST_SRC:test/%.c=$(BUILD)/%)
BENCH_SRC := $(wildcard bench/bench_*.c)
BENCH_BIN := $(BENCH_SRC:bench/%.c=$(BUILD)/%)
HEADERS   := $(wildcard include/*.h include/devpickle/*.h)

# Each Debian package with a header that shows it is there: a package counts as
# installed when the compiler finds its header (wherever it came from), so
# nothing asks for root (or dpkg) when everything is already installed. A
# package without a header (a tool) is named by its command: cmd/NAME.
DEB_PKGS  := libmsgpack-dev:msgpack.h libxxhash-dev:xxhash.h libcriterion-dev:criterion/criterion.h libjansson-dev:jansson.h \
             libucx-dev:ucp/api/ucp.h ucx-utils:cmd/ucx_perftest pkg-config:cmd/pkg-config

.PHONY: soak checksymbols checkheaders check-build check-install all lib cli test test-asan test-tsan gpu-test gpu-bundle fuzz deps-fuzz demo bench deps deps-check install uninstall clean help config FORCE

all: lib cli ## Build the static and shared library and the CLI (build/devpickle)

lib: $(BUILD)/libdevpickle.a $(BUILD)/libdevpickle.so ## Build the libraries only

cli: $(BUILD)/devpickle ## Build the CLI only

# Each compile writes the headers it read to $@.d (-MMD; -MP: a deleted header
# is no error), included at the end: an object is rebuilt when a header it
# includes changes, and only then.
DEPFLAGS   = -MMD -MP -MT $@ -MF $@.d

$(BUILD)/obj/%.o: %.c $(STAMPS)/cc | deps-check
	@mkdir -p $(dir $@)
	$(CC) $(DPFLAGS) $(SANFLAGS) $(CFLAGS) $(DEPFLAGS) -c $< -o $@

$(BUILD)/obj/device/cuda.o: DPFLAGS += $(CUDA_CFLAGS)

$(BUILD)/libdevpickle.a: $(LIB_OBJ)
	@mkdir -p $(BUILD)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/libdevpickle.so: $(LIB_OBJ) $(STAMPS)/ld
	$(CC) -shared -Wl,-soname,$(SONAME) $(SANFLAGS) -o $@ $(LIB_OBJ) $(LDLIBS)
	ln -sf libdevpickle.so $(BUILD)/$(SONAME)  # the name a program linked with -L$(BUILD) -ldevpickle loads

# The demo's CUDA kernels, when nvcc is there.
DEMO_CUDA := $(if $(and $(filter 1,$(HAVE_CUDA)),$(wildcard $(NVCC))),1,0)
ifeq ($(DEMO_CUDA),1)
CLI_OBJ   += $(BUILD)/obj/tools/demo_kernels.o
CLI_LIBS  := -lstdc++
$(BUILD)/obj/tools/demo.o: DPFLAGS += -DDP_DEMO_CUDA
endif

$(BUILD)/obj/tools/demo_kernels.o: tools/demo_kernels.cu $(STAMPS)/nvcc
	@mkdir -p $(dir $@)
	$(NVCC) $(GPU_ARCH) -O2 $(DEPFLAGS) -c $< -o $@

$(BUILD)/devpickle: $(CLI_OBJ) $(BUILD)/libdevpickle.a $(STAMPS)/ld
	$(CC) $(SANFLAGS) -o $@ $(CLI_OBJ) $(BUILD)/libdevpickle.a -ljansson $(LDLIBS) $(CLI_LIBS)

$(BUILD)/test_cli: LDLIBS += -ljansson
$(BUILD)/test_cli: TEST_OBJ = $(BUILD)/obj/tools/vjson.o
$(BUILD)/test_cli: $(BUILD)/obj/tools/vjson.o

$(BUILD)/test_%: test/test_%.c $(BUILD)/libdevpickle.a $(STAMPS)/test | deps-check
	$(CC) $(TFLAGS) $(SANFLAGS) $(CFLAGS) $(DEPFLAGS) -o $@ $< $(TEST_OBJ) $(BUILD)/libdevpickle.a -lcriterion $(LDLIBS)

$(BUILD)/bench_%: bench/bench_%.c $(BUILD)/libdevpickle.a $(STAMPS)/test | deps-check
	$(CC) $(TFLAGS) $(CUDA_CFLAGS) -O2 $(DEPFLAGS) -o $@ $< $(BUILD)/libdevpickle.a $(LDLIBS)

# One completion row in a process of its own (bench/one_row.c); not run by `make bench`.
$(BUILD)/one_row: bench/one_row.c bench/bench_future.c bench/bench.h $(BUILD)/libdevpickle.a $(STAMPS)/test | deps-check
	$(CC) $(TFLAGS) -Ibench $(CUDA_CFLAGS) -O2 $(DEPFLAGS) -o $@ $< $(BUILD)/libdevpickle.a $(LDLIBS)

$(BUILD)/embed: examples/embed.c $(BUILD)/libdevpickle.a $(STAMPS)/test | deps-check
	$(CC) $(TFLAGS) $(SANFLAGS) $(DEPFLAGS) -o $@ $< $(BUILD)/libdevpickle.a $(LDLIBS)

test: deps all $(TEST_BIN) $(BUILD)/embed ## Run the Criterion suites, the embedding example (also as installed) and the Python suite
	@set -e; for t in $(TEST_BIN); do echo "== $$t"; DEVPICKLE=$(BUILD)/devpickle $$t --jobs 2; done
	@echo "== $(BUILD)/embed"; $(BUILD)/embed
	@$(MAKE) --no-print-directory check-install
	@echo "== python (pytest)"; $(MAKE) --no-print-directory test-python

# Sanitizers. Criterion runs each test in a forked worker and ignores what
# LeakSanitizer prints when that worker exits, so the run's output is scanned
# for sanitizer reports: any report fails the target.
ASAN_BUILD := $(BUILD)/asan
ASAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer

test-asan: deps ## Run every suite under ASan + UBSan (+ LeakSanitizer, the Python suite aside); any report fails
	@$(MAKE) --no-print-directory BUILD=$(ASAN_BUILD) OPT="-O1 -g" SANFLAGS="$(ASAN_FLAGS)" all \
	  $(TEST_SRC:test/%.c=$(ASAN_BUILD)/%) $(ASAN_BUILD)/embed >/dev/null
	@set -e; log=$(ASAN_BUILD)/test-asan.log; : > $$log; \
	for t in $(TEST_SRC:test/%.c=$(ASAN_BUILD)/%) $(ASAN_BUILD)/embed; do \
	  echo "== $$t (asan)"; \
	  { ASAN_OPTIONS=detect_leaks=1:exitcode=23 LSAN_OPTIONS=suppressions=$(CURDIR)/test/lsan.supp:print_suppressions=0 \
	    UBSAN_OPTIONS=print_stacktrace=1 \
	    DEVPICKLE=$(ASAN_BUILD)/devpickle $$t --jobs 2 2>&1 && st=0 || st=$$?; echo "test-asan: $$t exited $$st"; } | \
	    tee -a $$log | grep -E 'Synthesis|^cuda|^frame|^test-asan: .* exited [1-9]' || true; \
	done; \
	if grep -qE 'Sanitizer|runtime error:|Synthesis: .*(Failing: [1-9]|Crashing: [1-9])|^test-asan: .* exited [1-9]' $$log; then \
	  grep -nE -A12 'ERROR: |runtime error:|SUMMARY:' $$log | head -80; \
	  echo "test-asan: sanitizer reports or failures (full log: $$log)"; exit 1; fi; \
	echo "test-asan: no sanitizer reports in the C suites"
	@$(MAKE) --no-print-directory test-python-asan

# GPU suite: built here (nvcc and the CUDA headers), run on a GPU machine
# (docs/PERFORMANCE.md says how); without a GPU every test skips with the reason.

$(BUILD)/gpu/kernels.o: test/gpu/kernels.cu $(STAMPS)/nvcc
	@mkdir -p $(dir $@)
	$(NVCC) $(GPU_ARCH) -O2 $(DEPFLAGS) -c $< -o $@

$(BUILD)/test_gpu: test/gpu/test_gpu.c $(BUILD)/gpu/kernels.o $(BUILD)/libdevpickle.a $(STAMPS)/test
	$(CC) $(TFLAGS) $(DEPFLAGS) -o $@ $< $(BUILD)/gpu/kernels.o $(BUILD)/libdevpickle.a -lcriterion $(LDLIBS) -lstdc++

gpu-test: deps ## Build the GPU suite (build/test_gpu) and run it here; tests skip, saying why, without a GPU
ifeq ($(DEMO_CUDA),1)
	@$(MAKE) --no-print-directory all $(BUILD)/test_gpu $(BENCH_BIN)
	$(BUILD)/test_gpu --verbose -j1
else
	@echo "gpu-test: no CUDA toolkit (headers and nvcc) under $(CUDA_HOME): the GPU suite cannot be built here"
endif

# Everything a GPU machine call needs, built here (../shared/GPU.md, beside
# the checkout, not in it, as ../shared/tools/bundle-libs is): the binaries in
# build/gpu-bin, their shared libraries, xxHash's header and the static
# msgpack-c and xxHash that python/gpu_run.sh links the extension with, in
# build/gpu-libs.
# Run there with carry [build/gpu-bin, build/gpu-libs, build/libdevpickle.a]:
#   BIN=build/gpu-bin sh bench/h200.sh $$OUT; bash python/gpu_run.sh $$OUT
GPU_BUNDLE := test_gpu test_future devpickle bench_future bench_pickler bench_device one_row
gpu-bundle: deps ## Gather the GPU binaries and their libraries in build/gpu-bin, build/gpu-libs, to run on a GPU machine (needs ../shared/tools/bundle-libs beside the checkout)
ifeq ($(DEMO_CUDA),1)
	@test -x ../shared/tools/bundle-libs || { echo "gpu-bundle: needs ../shared/tools/bundle-libs, beside the checkout (../shared/GPU.md); this tree has no ../shared" >&2; exit 1; }
	@$(MAKE) --no-print-directory all $(GPU_BUNDLE:%=$(BUILD)/%)
	rm -rf $(BUILD)/gpu-bin $(BUILD)/gpu-libs && mkdir -p $(BUILD)/gpu-bin $(BUILD)/gpu-libs/include
	cp $(GPU_BUNDLE:%=$(BUILD)/%) $(BUILD)/gpu-bin/
	../shared/tools/bundle-libs $(BUILD)/gpu-libs $(BUILD)/gpu-bin/*
	cp /usr/include/xxhash.h $(BUILD)/gpu-libs/include/
	cp $$(gcc -print-file-name=libmsgpackc.a) $$(gcc -print-file-name=libxxhash.a) $(BUILD)/gpu-libs/
else
	@echo "gpu-bundle: no CUDA toolkit (headers and nvcc) under $(CUDA_HOME): the GPU binaries cannot be built here"; exit 1
endif

# Fuzzing (libFuzzer, clang, ASan + UBSan). Each target is linked with the
# library sources built alike (objects under build/fuzz/obj). Corpora grow in build/fuzz/corpus, seeded from
# test/fuzz/corpus; findings land in build/fuzz/artifacts and fail the run.
FUZZ_SECONDS ?= 60
FUZZ_BUILD   := $(BUILD)/fuzz
FUZZ_TARGETS := unpickle frame_readers value_json roundtrip
FUZZ_FLAGS   := -std=c11 -D_POSIX_C_SOURCE=200809L -g -O1 -Iinclude \
                -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
FUZZ_SRC     := $(wildcard core/*.c value/*.c pickler/*.c) tools/vjson.c tools/inspect.c
FUZZ_OBJ     := $(FUZZ_SRC:%.c=$(FUZZ_BUILD)/obj/%.o)

deps-fuzz: ## Install clang and libFuzzer's runtime for `make fuzz` (make fuzz does it itself)
	@command -v clang >/dev/null && ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 || \
	  { echo "devpickle: installing clang and libclang-rt-dev for libFuzzer"; \
	    (apt-get install -y -q clang libclang-rt-dev || (apt-get update -q && apt-get install -y -q clang libclang-rt-dev)) >/dev/null || \
	    { echo "devpickle: run: apt-get install -y clang libclang-rt-dev" >&2; exit 1; }; }

$(FUZZ_BUILD)/obj/%.o: %.c $(STAMPS)/fuzz | deps-fuzz deps-check
	@mkdir -p $(dir $@)
	clang $(FUZZ_FLAGS) $(DEPFLAGS) -c $< -o $@

$(FUZZ_TARGETS:%=$(FUZZ_BUILD)/fuzz_%): $(FUZZ_BUILD)/fuzz_%: $(FUZZ_BUILD)/obj/test/fuzz/fuzz_%.o $(FUZZ_OBJ)
	clang $(FUZZ_FLAGS) -o $@ $< $(FUZZ_OBJ) -lmsgpackc -lxxhash -ljansson -lpthread -lm

fuzz: deps deps-fuzz $(FUZZ_TARGETS:%=$(FUZZ_BUILD)/fuzz_%) ## Run every fuzz target for FUZZ_SECONDS (default 60); any finding fails
	@set -e; mkdir -p $(FUZZ_BUILD)/artifacts; : > $(FUZZ_BUILD)/stats.txt; \
	for t in $(FUZZ_TARGETS); do \
	  case $$t in value_json) c=value_json; d=test/fuzz/json.dict;; roundtrip) c=roundtrip; d=test/fuzz/dpk.dict;; \
	    *) c=unpickle; d=test/fuzz/dpk.dict;; esac; \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$t; \
	  echo "== fuzz_$$t for $(FUZZ_SECONDS) s"; \
	  if ! $(FUZZ_BUILD)/fuzz_$$t $(FUZZ_BUILD)/corpus/$$t test/fuzz/corpus/$$c -dict=$$d \
	       -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
	       -artifact_prefix=$(FUZZ_BUILD)/artifacts/$$t- > $(FUZZ_BUILD)/$$t.log 2>&1; then \
	    tail -40 $(FUZZ_BUILD)/$$t.log; echo "fuzz: fuzz_$$t found a problem (artifacts in $(FUZZ_BUILD)/artifacts)"; exit 1; fi; \
	  execs=$$(sed -n 's/^stat::number_of_executed_units: *//p' $(FUZZ_BUILD)/$$t.log); \
	  echo "fuzz_$$t $$execs" >> $(FUZZ_BUILD)/stats.txt; echo "fuzz_$$t: $$execs executions, no finding"; \
	done

SOAK_SECONDS ?= 60

$(BUILD)/soak: test/stress/soak.c $(BUILD)/libdevpickle.a $(STAMPS)/test | deps-check
	$(CC) $(TFLAGS) $(SANFLAGS) $(DEPFLAGS) -o $@ $< $(BUILD)/libdevpickle.a $(LDLIBS)

soak: deps ## Hammer futures, the allocator and pickling from 4 threads for SOAK_SECONDS with failures injected (ASan build)
	@$(MAKE) --no-print-directory BUILD=$(ASAN_BUILD) OPT="-O1 -g" SANFLAGS="$(ASAN_FLAGS)" $(ASAN_BUILD)/soak >/dev/null
	ASAN_OPTIONS=detect_leaks=1 $(ASAN_BUILD)/soak $(SOAK_SECONDS)

TSAN_BUILD := $(BUILD)/tsan

$(BUILD)/stress $(BUILD)/transport_stress: $(BUILD)/%: test/stress/%.c $(BUILD)/libdevpickle.a $(STAMPS)/test | deps-check
	$(CC) $(TFLAGS) $(SANFLAGS) $(DEPFLAGS) -o $@ $< $(BUILD)/libdevpickle.a $(LDLIBS)

# Criterion cannot start under ThreadSanitizer, so the concurrent scenarios
# live in test/stress (the transport's in transport_stress, with UCX's memory
# hooks off: they intercept madvise at thread exit, after TSan let go).
# The racy control must be reported, or the check is blind and the target
# fails. It gets three runs: ThreadSanitizer from GCC 12 can fail to start
# under some address-space layouts, and a run that did not start proves
# nothing either way (its output is printed).
test-tsan: deps ## Run the concurrency stress and the Python suite under ThreadSanitizer (and check that racy controls are caught)
	@$(MAKE) --no-print-directory BUILD=$(TSAN_BUILD) OPT="-O1 -g" SANFLAGS="-fsanitize=thread" $(TSAN_BUILD)/stress $(TSAN_BUILD)/transport_stress >/dev/null
	@log=$(TSAN_BUILD)/test-tsan.log; \
	TSAN_OPTIONS=halt_on_error=0 $(TSAN_BUILD)/stress > $$log 2>&1; rc=$$?; \
	UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_MALLOC_HOOKS=no TSAN_OPTIONS=halt_on_error=0 \
	  $(TSAN_BUILD)/transport_stress >> $$log 2>&1 || rc=1; \
	cat $$log | grep -vE '^(==|  |    #|SUMMARY|WARNING|Previous|Location|Mutex|Thread|  Thread)' ; \
	if [ $$rc -ne 0 ] || grep -q 'ThreadSanitizer' $$log; then \
	  grep -nE -A24 'WARNING: ThreadSanitizer' $$log | head -80; echo "test-tsan: reports or failures (log: $$log)"; exit 1; fi; \
	for try in 1 2 3; do \
	  TSAN_OPTIONS=halt_on_error=0 $(TSAN_BUILD)/stress --control > $$log.control 2>&1; \
	  grep -q 'WARNING: ThreadSanitizer: data race' $$log.control && break; \
	  echo "test-tsan: run $$try of the racy control was not reported; its output:"; tail -20 $$log.control; \
	done; \
	if ! grep -q 'WARNING: ThreadSanitizer: data race' $$log.control; then \
	  echo "test-tsan: the racy control was NOT reported in 3 runs: the check is blind"; exit 1; fi; \
	echo "test-tsan: no reports; the racy control was reported as it must be"
	@$(MAKE) --no-print-directory test-python-tsan

demo: deps all ## The future pipeline end to end (devpickle demo), then the examples packed, verified, dumped, unpacked and packed back
	@sh tools/demo.sh $(BUILD)/devpickle

bench: all $(BENCH_BIN) python ## Run the benchmarks (C, then Python against PyTorch); results in build/bench.json
	@rm -f $(BUILD)/bench.json
	@set -e; for b in $(BENCH_BIN); do $$b $(BUILD)/bench.json; done
	PYTHONPATH=$(abspath $(PY_BUILD)) $(PYTHON) bench/py_bench.py $(BUILD)/bench.json
	@echo "wrote $(BUILD)/bench.json"

include python/python.mk

# Dependencies: Debian packages, installed when missing.
deps: ## Install the missing Debian packages (apt-get; needs root only when one is missing)
	@missing=""; for ph in $(DEB_PKGS); do c="$${ph#*:}"; \
	  case "$$c" in cmd/*) command -v "$${c#cmd/}" >/dev/null 2>&1 ;; \
	    *) printf '#include <%s>\n' "$$c" | $(CC) -E -x c - >/dev/null 2>&1 ;; esac || missing="$$missing $${ph%%:*}"; done; \
	if [ -z "$$missing" ]; then echo "devpickle: the Debian packages are present ($(foreach p,$(DEB_PKGS),$(firstword $(subst :, ,$(p)))))"; exit 0; fi; \
	echo "devpickle: installing$$missing"; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "devpickle: cannot install packages here; run: sudo apt-get install -y$$missing" >&2; exit 1; fi; \
	(apt-get install -y -q $$missing || (apt-get update -q && apt-get install -y -q $$missing)) >/dev/null || \
	  { echo "devpickle: apt-get failed; run: apt-get update && apt-get install -y$$missing" >&2; exit 1; }

deps-check: ## Check that the C library's headers are installed (every build does it first)
	@printf '#include <msgpack.h>\n#include <xxhash.h>\n#include <ucp/api/ucp.h>\n' | $(CC) -E -x c - >/dev/null 2>&1 || \
	  { echo "devpickle: msgpack-c, xxHash or UCX headers missing: run 'make deps'" >&2; exit 1; }

config: ## Show what the build found: compiler, CUDA, PREFIX, the Python binding's interpreter and torch adapter
	@echo "CC=$(CC) CUDA=$(HAVE_CUDA) ($(CUDA_HOME)) PREFIX=$(PREFIX) VERSION=$(VERSION)"
	@echo "PYTHON=$(PYTHON) ($(if $(wildcard $(PY_INC)/Python.h),Python.h in $(PY_INC),no Python.h: make python installs python3-dev))"
	@err=$$($(PYTHON) python/build_torch_adapter.py --dry-run --out $(PY_BUILD)/devpickle 2>&1 >/dev/null) \
	  && echo "torch adapter: make python builds it" \
	  || echo "torch adapter: not built: $$(printf '%s\n' "$$err" | sed -n 's/^build_torch_adapter: //p' | head -1)"

$(BUILD)/devpickle.pc: Makefile $(STAMPS)/pc
	@mkdir -p $(BUILD)
	@printf 'prefix=%s\nincludedir=$${prefix}/include\nlibdir=$${prefix}/lib\nstaticlibs=$${libdir}/libdevpickle.a $(LDLIBS)\n\nName: devpickle\nDescription: Finds the device allocations a value references; frames for transport\nVersion: %s\nLibs: -L$${libdir} -ldevpickle\nLibs.private: $(LDLIBS)\nCflags: -I$${includedir}\n' '$(PREFIX)' '$(VERSION)' > $@

install: all $(BUILD)/devpickle.pc ## Install headers, libraries, CLI and devpickle.pc (PREFIX, DESTDIR)
	install -d $(DESTDIR)$(PREFIX)/include/devpickle $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin
	install -m 644 include/devpickle.h $(DESTDIR)$(PREFIX)/include/
	install -m 644 include/devpickle/*.h $(DESTDIR)$(PREFIX)/include/devpickle/
	install -m 644 $(BUILD)/libdevpickle.a $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(BUILD)/libdevpickle.so $(DESTDIR)$(PREFIX)/lib/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(PREFIX)/lib/libdevpickle.so
	install -m 644 $(BUILD)/devpickle.pc $(DESTDIR)$(PREFIX)/lib/pkgconfig/
	install -m 755 $(BUILD)/devpickle $(DESTDIR)$(PREFIX)/bin/
	@# The loader finds a new library in a directory it searches (/usr/local/lib)
	@# only through its cache: refresh it, as root, for an install in place.
	@# Not root: the cache stays as it was; say what a program linked without
	@# an rpath needs. Root, but a PREFIX the loader does not search: the
	@# refreshed cache still lacks the library; say so too.
	@if [ -z "$(DESTDIR)" ] && [ "$$(id -u)" = 0 ] && command -v ldconfig >/dev/null; then ldconfig; \
	  ldconfig -p | grep -qF " => $(abspath $(PREFIX))/lib/$(SONAME)" || echo "devpickle: the loader does not search $(PREFIX)/lib: for a program to find $(SONAME), link it with -Wl,-rpath,$(PREFIX)/lib or set LD_LIBRARY_PATH=$(PREFIX)/lib"; \
	elif [ -z "$(DESTDIR)" ]; then echo "devpickle: not root, so the loader's cache was not refreshed: for a program to find $(SONAME), link it with -Wl,-rpath,$(PREFIX)/lib, set LD_LIBRARY_PATH=$(PREFIX)/lib, or (where the loader searches $(PREFIX)/lib) run ldconfig as root"; fi

uninstall: ## Remove what install put in place
	rm -f $(DESTDIR)$(PREFIX)/include/devpickle.h $(DESTDIR)$(PREFIX)/lib/libdevpickle.a \
	  $(DESTDIR)$(PREFIX)/lib/libdevpickle.so $(DESTDIR)$(PREFIX)/lib/$(SONAME) \
	  $(DESTDIR)$(PREFIX)/lib/pkgconfig/devpickle.pc $(DESTDIR)$(PREFIX)/bin/devpickle
	rm -rf $(DESTDIR)$(PREFIX)/include/devpickle
	@if [ -z "$(DESTDIR)" ] && [ "$$(id -u)" = 0 ] && command -v ldconfig >/dev/null; then ldconfig; fi

# The embedding example built as README, "Embedding", tells a user to build it:
# installed under a PREFIX the loader does not search, found through
# PKG_CONFIG_PATH, linked shared (with the rpath) and static (staticlibs), each
# binary run. DESTDIR=/ keeps install from running ldconfig for a directory
# the loader never searches.
INSTALL_CHECK = $(abspath $(BUILD))/install-check
check-install: all ## Install under build/install-check; build examples/embed.c through pkg-config, shared and static; run both
	@command -v pkg-config >/dev/null || { echo "check-install: pkg-config is missing: run 'make deps'" >&2; exit 1; }
	@rm -rf $(INSTALL_CHECK)
	@$(MAKE) --no-print-directory PREFIX=$(INSTALL_CHECK)/prefix DESTDIR=/ install >/dev/null
	@set -e; p=$(INSTALL_CHECK)/prefix; export PKG_CONFIG_PATH=$$p/lib/pkgconfig; \
	v=$$(pkg-config --modversion devpickle); [ "$$v" = "$(VERSION)" ] || \
	  { echo "check-install: pkg-config says version '$$v', the headers $(VERSION)" >&2; exit 1; }; \
	$(CC) -std=c11 -Wall -Wextra -Werror examples/embed.c $$(pkg-config --cflags --libs devpickle) \
	  -Wl,-rpath,$$(pkg-config --variable=libdir devpickle) -o $(INSTALL_CHECK)/embed-shared; \
	$(CC) -std=c11 -Wall -Wextra -Werror examples/embed.c $$(pkg-config --cflags devpickle) \
	  $$(pkg-config --variable=staticlibs devpickle) -o $(INSTALL_CHECK)/embed-static; \
	ldd $(INSTALL_CHECK)/embed-shared | grep -q " $$p/lib/$(SONAME) " || \
	  { echo "check-install: embed-shared does not load $$p/lib/$(SONAME)" >&2; exit 1; }; \
	! ldd $(INSTALL_CHECK)/embed-static | grep libdevpickle || \
	  { echo "check-install: embed-static depends on libdevpickle.so" >&2; exit 1; }; \
	$(INSTALL_CHECK)/embed-shared >/dev/null; $(INSTALL_CHECK)/embed-static >/dev/null; \
	echo "check-install: examples/embed.c built through pkg-config from $$p, shared and static; both ran"

check-build: ## Check, on a copy of the tree, that a change (header, CFLAGS, PREFIX, version) rebuilds what it affects
	@sh test/build/check.sh

checksymbols: lib ## Fail if the libraries export a symbol without the dp_ prefix
	@bad=$$(nm -D --defined-only $(BUILD)/libdevpickle.so | awk '{print $$3}' | grep -v '^dp_' || true); \
	bad="$$bad $$(nm -g --defined-only $(LIB_OBJ) 2>/dev/null | awk 'NF==3 {print $$3}' | grep -v '^dp_' || true)"; \
	if [ -n "$$(echo $$bad | tr -d ' ')" ]; then echo "checksymbols: symbols without the dp_ prefix:"; echo $$bad | tr ' ' '\n'; exit 1; fi; \
	echo "checksymbols: $$(nm -D --defined-only $(BUILD)/libdevpickle.so | wc -l) exported symbols, all dp_"

checkheaders: ## Compile each public header alone, as C11 and as C++11
	@set -e; mkdir -p $(BUILD)/headers; for h in $(HEADERS); do \
	  n=$$(echo $$h | tr '/.' '__'); printf '#include "%s"\n#include "%s"\n' $${h#include/} $${h#include/} > $(BUILD)/headers/$$n.c; \
	  $(CC) -std=c11 -Wall -Wextra -Werror -pedantic -Iinclude -fsyntax-only $(BUILD)/headers/$$n.c; \
	  cp $(BUILD)/headers/$$n.c $(BUILD)/headers/$$n.cpp; \
	  $(CXX) -std=c++11 -Wall -Wextra -Werror -Iinclude -fsyntax-only $(BUILD)/headers/$$n.cpp; \
	done; echo "checkheaders: $(words $(HEADERS)) headers stand alone in C11 and C++11"

clean: ## Remove build/
	rm -rf $(BUILD)

help: ## List the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | awk -F'\t' '{printf "  %-17s %s\n", $$1, $$2}'

# ---- what a build depends on besides files ----
# Each stamp holds the values of the variables a group of outputs is built
# with; it is rewritten only when they change, so those outputs are rebuilt
# then (a new PREFIX rewrites devpickle.pc, a new CFLAGS recompiles). The
# recipe runs even under `make -n` (+), so a dry run shows the truth. The values
# are taken here, before any target-specific variable, so every target sees
# the same value.
STAMP_cc   := $(CC) $(DPFLAGS) $(SANFLAGS) $(CFLAGS) $(CUDA_CFLAGS) $(DEMO_CUDA)
STAMP_test := $(CC) $(TFLAGS) $(SANFLAGS) $(CFLAGS) $(CUDA_CFLAGS) $(LDLIBS)
STAMP_ld   := $(CC) $(SANFLAGS) $(LDLIBS) $(CLI_LIBS) $(SONAME)
STAMP_nvcc := $(NVCC) $(GPU_ARCH)
STAMP_fuzz := $(FUZZ_FLAGS)
STAMP_pc   := $(PREFIX) $(VERSION) $(LDLIBS)

STAMP_FILES := $(addprefix $(STAMPS)/,cc test ld nvcc fuzz pc)
$(STAMP_FILES): $(STAMPS)/%: FORCE
	+@mkdir -p $(STAMPS); v='$(subst ','\'',$(STAMP_$*))'; \
	  [ -f $@ ] && [ "$$(cat $@)" = "$$v" ] || printf '%s\n' "$$v" > $@

FORCE:

-include $(wildcard $(BUILD)/obj/*/*.d $(BUILD)/*.d $(BUILD)/gpu/*.d $(FUZZ_BUILD)/obj/*/*.d $(FUZZ_BUILD)/obj/test/fuzz/*.d)
