# The Python binding (python/): `make python` builds the package into
# build/python/devpickle, importable with PYTHONPATH=build/python. Included by
# the Makefile.

PYTHON      ?= /usr/bin/python3
PY_BUILD    := $(BUILD)/python
PY_SRC      := $(wildcard python/src/*.c)
PY_HDR      := $(wildcard python/src/*.h)
PY_FILES    := $(wildcard python/devpickle/*.py python/devpickle/*.pyi) python/devpickle/py.typed
PY_CONF      = $(shell $(PYTHON) -c 'import sysconfig as s; print(s.get_paths()["include"], s.get_config_var("EXT_SUFFIX"))' 2>/dev/null)
PY_INC       = $(word 1,$(PY_CONF))
PY_SUFFIX    = $(word 2,$(PY_CONF))
PY_EXT       = $(PY_BUILD)/devpickle/_devpickle$(PY_SUFFIX)
PY_CFLAGS   := -std=c11 -Wall -Wextra -Werror -Wno-missing-field-initializers -O2 -g -fPIC -fvisibility=hidden -Iinclude

python: lib deps-python ## Build the Python package into build/python/devpickle (PYTHON=/usr/bin/python3)
	@test -n "$(PY_INC)" -a -f "$(PY_INC)/Python.h" || { echo "devpickle: no Python.h for $(PYTHON): run 'make deps'" >&2; exit 1; }
	@$(MAKE) --no-print-directory PYTHON=$(PYTHON) $(PY_EXT) $(PY_FILES:python/%=$(PY_BUILD)/%)
	@$(PYTHON) python/build_torch_adapter.py --out $(PY_BUILD)/devpickle --if-available
	@echo "devpickle: built $(abspath $(PY_BUILD))/devpickle; import it with PYTHONPATH=$(abspath $(PY_BUILD))"

$(PY_BUILD)/devpickle/_devpickle%.so: $(PY_SRC) $(PY_HDR) $(BUILD)/libdevpickle.a $(HEADERS)
	@mkdir -p $(dir $@)
	$(CC) $(PY_CFLAGS) $(SANFLAGS) $(CUDA_CFLAGS) -I$(PY_INC) -shared -o $@ $(PY_SRC) $(BUILD)/libdevpickle.a \
	  -Wl,--exclude-libs,ALL $(LDLIBS)

$(PY_BUILD)/devpickle/%: python/devpickle/%
	@mkdir -p $(dir $@)
	cp $< $@

# cli too: the suite checks its frames against the CLI's (DEVPICKLE), and
# those tests would skip in a tree where it is not built yet.
test-python: python cli ## Run the Python suite (pytest) against the built package and the CLI
	PYTHONPATH=$(abspath $(PY_BUILD)) DEVPICKLE=$(abspath $(BUILD)/devpickle) \
	  $(PYTHON) -m pytest -q -p no:cacheprovider python/tests

# The Python suite under ASan and UBSan (test-asan runs it after the C
# suites): the extension and the library it links are built with the
# sanitizers (BUILD=$(ASAN_BUILD), SANFLAGS), and the interpreter, which is
# not, loads their runtimes first (PYTHONMALLOC=malloc: the interpreter's
# own small-block allocator would hide overruns of its blocks from ASan).
# LeakSanitizer stays off here: the
# interpreter keeps what it allocates until it exits (the suite's own tests
# count references and tracemalloc's blocks instead). A report aborts the
# process it is made in: the interpreter, which fails the run, or a child a
# test runs, which fails that test — unless the test expects the child to
# crash (torch's side of a comparison); the reports, written to files,
# are shown when the run fails.
test-python-asan: deps-python ## The Python suite alone under ASan + UBSan (test-asan runs it)
	@$(MAKE) --no-print-directory BUILD=$(ASAN_BUILD) OPT="-O1 -g" SANFLAGS="$(ASAN_FLAGS)" cli python >/dev/null
	@echo "== python (pytest, asan)"; log=$(abspath $(ASAN_BUILD))/python-asan; rm -f $$log.*; \
	LD_PRELOAD="$$($(CC) -print-file-name=libasan.so) $$($(CC) -print-file-name=libubsan.so)" \
	  PYTHONMALLOC=malloc ASAN_OPTIONS=detect_leaks=0:log_path=$$log UBSAN_OPTIONS=print_stacktrace=1:log_path=$$log \
	  PYTHONPATH=$(abspath $(ASAN_BUILD)/python) DEVPICKLE=$(abspath $(ASAN_BUILD)/devpickle) \
	  $(PYTHON) -m pytest -q -p no:cacheprovider python/tests && exit 0; \
	rc=$$?; ls $$log.* >/dev/null 2>&1 && head -60 $$log.*; echo "test-python-asan: failed ($$rc)"; exit $$rc

# The Python suite under ThreadSanitizer (test-tsan runs it after the C
# stress): the extension and the library built with it, its runtime loaded
# first into the interpreter, which is not (test/tsan-python.supp names
# what that leaves unseen). Any report of a race — from the interpreter or
# from a CLI a test runs — fails the run (a crash expected of torch's side
# of a comparison is no race); then a racy control, two threads writing the
# same bytes through ctypes, must be reported, or the check is blind.
TSAN_PY_ENV = LD_PRELOAD="$$($(CC) -print-file-name=libtsan.so)" UCX_MEM_MMAP_HOOK_MODE=none UCX_MEM_MALLOC_HOOKS=no \
  TSAN_OPTIONS="halt_on_error=0 log_path=$$log suppressions=$(abspath test/tsan-python.supp)"
test-python-tsan: deps-python ## The Python suite alone under ThreadSanitizer, with a racy control (test-tsan runs it)
	@$(MAKE) --no-print-directory BUILD=$(TSAN_BUILD) OPT="-O1 -g" SANFLAGS="-fsanitize=thread" cli python >/dev/null
	@echo "== python (pytest, tsan)"; log=$(abspath $(TSAN_BUILD))/python-tsan; rm -f $$log.*; \
	$(TSAN_PY_ENV) PYTHONPATH=$(abspath $(TSAN_BUILD)/python) DEVPICKLE=$(abspath $(TSAN_BUILD)/devpickle) \
	  $(PYTHON) -m pytest -q -p no:cacheprovider python/tests && rc=0 || rc=$$?; \
	if grep -l 'WARNING: ThreadSanitizer' $$log.* >/dev/null 2>&1; then \
	  grep -h -A30 'WARNING: ThreadSanitizer' $$log.* | head -80; rc=1; fi; \
	[ $$rc -eq 0 ] || { echo "test-python-tsan: failed ($$rc; reports in $$log.*)"; exit 1; }; \
	log=$(abspath $(TSAN_BUILD))/python-tsan-control; rm -f $$log.*; \
	$(TSAN_PY_ENV) $(PYTHON) test/tsan_python_control.py >/dev/null; \
	grep -q 'WARNING: ThreadSanitizer: data race' $$log.* 2>/dev/null || \
	  { echo "test-python-tsan: the racy control was NOT reported: the check is blind"; exit 1; }; \
	echo "test-python-tsan: no reports; the racy control was reported as it must be"

# Debian's interpreter and the packages the binding (Python.h; libtorch-dev
# for the optional torch adapter) and its tests need.
PY_DEB := python3-dev python3-pytest python3-numpy python3-torch libtorch-dev python3-pip python3-venv
deps-python: ## Install the Python suite's packages for /usr/bin/python3 (make python does it itself)
	@$(PYTHON) -c 'import sysconfig, os; assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' 2>/dev/null && \
	  { [ "$(PYTHON)" != /usr/bin/python3 ] || /usr/bin/python3 -c 'import pytest, numpy, torch, pip, venv' 2>/dev/null && \
	    test -f /usr/include/torch/csrc/autograd/python_variable.h; } && exit 0; \
	echo "devpickle: installing $(PY_DEB)"; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "devpickle: cannot install packages here; run: sudo apt-get install -y $(PY_DEB)" >&2; exit 1; fi; \
	(apt-get install -y -q $(PY_DEB) || (apt-get update -q && apt-get install -y -q $(PY_DEB))) >/dev/null || \
	  { echo "devpickle: apt-get failed; run: apt-get update && apt-get install -y $(PY_DEB)" >&2; exit 1; }

# pip install ./python, offline, into a fresh virtual environment that sees
# Debian's packages; then the installed package works outside the tree.
check-pip: deps-python ## Check that `pip install ./python` works offline (a venv under build/)
	@rm -rf $(BUILD)/venv && /usr/bin/python3 -m venv --system-site-packages $(BUILD)/venv
	$(BUILD)/venv/bin/pip install -q --no-index ./python
	cd / && $(abspath $(BUILD))/venv/bin/python -c 'import devpickle, torch; \
	  r = devpickle.scan({"t": torch.ones(2)}); assert r[0].path == "$$.t", r; \
	  a = devpickle._devpickle._torch_adapter(); assert a == "python", "build isolation hides torch, yet the adapter is " + repr(a); \
	  import os; d = os.path.dirname(devpickle.__file__); assert {"py.typed", "_devpickle.pyi"} <= set(os.listdir(d)), d; \
	  print("check-pip: installed", devpickle.__file__, "with its types")'

.PHONY: python test-python test-python-asan test-python-tsan deps-python check-pip
