# kvxfer — build, test, demo, bundle.  `make help` lists the targets.
PREFIX  ?= /usr/local
DESTDIR ?=
CC      ?= cc

# UCX: the UCX the daemon, fake_peer and the tests build against, each in
# a BUILD folder of its own (README.md, "Which UCX"):
#   UCX=debian   Debian's libucx-dev by pkg-config (the default), in build
#   UCX=wheel    PyPI's libucx-cu13 (CUDA transports), which
#                scripts/ucx-wheel.sh fetches into build/ucx-wheel, in
#                build-ucx-wheel
#   UCX=/prefix  a UCX installed under /prefix, by its ucx.pc, in
#                build-ucx-site
# The wheel's and a site's headers are included with -isystem (theirs trip
# -Wsign-compare) and their lib folder is the binaries' run path.
UCX ?= debian
ifeq ($(UCX),debian)
BUILD ?= build
else ifeq ($(UCX),wheel)
BUILD ?= build-ucx-wheel
else
BUILD ?= build-ucx-site
endif

PKGS     := libuv libprotobuf-c yaml-0.1
PKG_CFLAGS := $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   := $(shell pkg-config --libs $(PKGS) 2>/dev/null)
# the daemon alone talks UCX and computes HMACs (peer daemons).
# UCX_VERSION: the version built against (kvxferd --version); UCX_DEP:
# what must exist before anything is compiled against it
ifeq ($(UCX),debian)
DAEMON_PKGS := ucx libcrypto
PKG_CFLAGS += $(shell pkg-config --cflags $(DAEMON_PKGS) 2>/dev/null)
DAEMON_LIBS := $(shell pkg-config --libs $(DAEMON_PKGS) 2>/dev/null)
UCX_VERSION := $(shell pkg-config --modversion ucx 2>/dev/null)
UCX_DEP :=
UCX_BUNDLE :=
else ifeq ($(UCX),wheel)
UCX_WHEEL_DIR := build/ucx-wheel
UCX_HOME    := $(abspath $(UCX_WHEEL_DIR))/libucx
UCX_VERSION := $(shell scripts/ucx-wheel.sh --version)
UCX_DEP     := $(UCX_HOME)/.kvx-ok
PKG_CFLAGS  += -isystem $(UCX_HOME)/include \
               $(shell pkg-config --cflags libcrypto 2>/dev/null)
DAEMON_LIBS := -L$(UCX_HOME)/lib -Wl,-rpath,$(UCX_HOME)/lib \
               -Wl,-rpath,'$$ORIGIN/../lib' \
               -lucp -luct -lucs -lucm $(shell pkg-config --libs libcrypto 2>/dev/null)
UCX_BUNDLE  := $(UCX_HOME) $(abspath $(UCX_WHEEL_DIR))/libucx_cu13.libs
else
# only its own .pc files, not the system's ucx.pc; their prefix where
# they are (a moved install's, or the wheel's, name another)
UCX_PREFIX := $(abspath $(UCX))
UCX_PC := PKG_CONFIG_LIBDIR=$(UCX_PREFIX)/lib/pkgconfig:$(UCX_PREFIX)/lib64/pkgconfig \
          pkg-config --define-prefix
ifeq ($(shell $(UCX_PC) --exists ucx && echo y),)
$(error UCX=$(UCX): no ucx.pc under $(UCX_PREFIX)/lib/pkgconfig or lib64/pkgconfig (UCX is debian, wheel or a UCX install prefix))
endif
UCX_VERSION := $(shell $(UCX_PC) --modversion ucx)
UCX_DEP     :=
PKG_CFLAGS  += $(patsubst -I%,-isystem %,$(shell $(UCX_PC) --cflags ucx)) \
               $(shell pkg-config --cflags libcrypto 2>/dev/null)
DAEMON_LIBS := $(shell $(UCX_PC) --libs ucx) \
               -Wl,-rpath,$(shell $(UCX_PC) --variable=libdir ucx) \
               -Wl,-rpath,'$$ORIGIN/../lib' \
               $(shell pkg-config --libs libcrypto 2>/dev/null)
UCX_BUNDLE  := $(UCX_PREFIX)
endif

# journald's native protocol (log.format journal) through Debian's
# libsystemd-dev (scripts/deps.sh installs it); a build without it
# refuses that format, naming the package
JOURNAL_LIBS := $(shell pkg-config --libs libsystemd 2>/dev/null)
ifneq ($(JOURNAL_LIBS),)
DAEMON_LIBS += $(JOURNAL_LIBS)
$(BUILD)/obj/daemon/core/log.o: CFLAGS += -DKVX_JOURNAL
$(BUILD)/tests/test_log: CFLAGS += -DKVX_JOURNAL
endif

# the metrics endpoint (daemon/local/http.c): libmicrohttpd, the daemon's
# alone
PKG_CFLAGS  += $(shell pkg-config --cflags libmicrohttpd 2>/dev/null)
DAEMON_LIBS += $(shell pkg-config --libs libmicrohttpd 2>/dev/null)

# one folder per layer (docs/architecture.md): the public header is the
# ground; an include across folders names its folder ("net/peer.h",
# "common/list.h"), so only the roots are on the path
INCLUDES := -Iclient/include -I. -Idaemon

OPT      ?= -O2
SAN      ?=
# KVX_ALLOW_DEPRECATED: kvxfer's own tools and tests still call the 2.x
# variants (kvxfer.h's KVX_DEPRECATED) under -Werror
CFLAGS   += $(OPT) -g -std=gnu11 -Wall -Wextra -Werror -fPIC $(SAN) \
            -D_GNU_SOURCE -DKVX_ALLOW_DEPRECATED -I$(BUILD)/gen $(INCLUDES) \
            $(PKG_CFLAGS)
LDFLAGS  += $(SAN)
LIBS     := $(PKG_LIBS) -lpthread

# kvxfer-bench: main, its options table, ranks, daemons, baselines,
# layer-wise and report (tools/bench.h)
BENCH_SRC := tools/bench.c tools/bench_opts.c tools/bench_verify.c \
             tools/bench_rank.c tools/bench_daemon.c tools/bench_baseline.c \
             tools/bench_layerwise.c tools/bench_report.c
BENCH_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(BENCH_SRC))

# CUDA: with nvcc on PATH (or NVCC=...), the daemon gets the GPU data
# plane (kernels for sm_80, sm_90, sm_100 + PTX, CUDA runtime linked
# statically); CUDA=0 forces a host-only build.
NVCC     ?= $(shell command -v nvcc 2>/dev/null)
CUDA     ?= $(if $(NVCC),1,0)
ifeq ($(CUDA),1)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_VER  := $(shell $(NVCC) --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
GPU_SRC   := daemon/copy/gpu.c daemon/copy/gpu_dma.c
GPU_OBJ   := $(BUILD)/obj/daemon/copy/gpu_kernel.o
CUDA_LIBS := -L$(CUDA_HOME)/lib64 -lcudart_static -ldl -lrt
NVCCFLAGS ?= -O3 -std=c++17 -Xcompiler -fPIC,-fno-threadsafe-statics \
             -gencode arch=compute_80,code=sm_80 \
             -gencode arch=compute_90,code=sm_90 \
             -gencode arch=compute_100,code=sm_100 \
             -gencode arch=compute_100,code=compute_100
$(BUILD)/obj/daemon/copy/gpu.o $(BUILD)/obj/daemon/copy/gpu_dma.o: \
             CFLAGS += -I$(CUDA_HOME)/include \
             -DKVX_CUDA_VERSION='"$(CUDA_VER)"'
$(BENCH_OBJ): CFLAGS += -DKVX_CUDA
BENCH_GPU_OBJ := $(BUILD)/obj/tools/bench_gpu.o
else
BENCH_GPU_OBJ :=
GPU_SRC   := daemon/copy/gpu_none.c
GPU_OBJ   :=
CUDA_LIBS :=
endif

GEN      := $(BUILD)/gen/kvxfer.pb-c.c $(BUILD)/gen/kvxfer.pb-c.h
COMMON   := common/status.c common/frame.c common/layout.c common/reqkey.c \
            common/reqrec.c \
            common/why.c
CLIENT   := $(COMMON) client/conn.c client/pool.c client/calls.c \
            client/verbs.c client/compat.c client/abi2.c \
            client/json.c client/reconnect.c
DAEMON   := $(COMMON) \
            daemon/core/log.c daemon/core/conf.c daemon/core/conf_keys.c \
            daemon/core/notify.c daemon/core/daemon.c daemon/core/fault.c \
            daemon/core/records.c \
            daemon/net/ucx.c daemon/net/ucx_addr.c daemon/net/hs.c \
            daemon/net/lane.c \
            daemon/net/peer.c daemon/net/peer_auth.c daemon/net/peer_addr.c \
            daemon/net/peer_handshake.c daemon/net/peer_init.c \
            daemon/net/peer_status.c daemon/net/peer_rails.c \
            daemon/net/topo.c \
            daemon/copy/pool.c daemon/copy/copy.c daemon/copy/plan.c \
            daemon/copy/gpu_desc.c \
            daemon/xfer/instance.c daemon/xfer/xfer.c daemon/xfer/params.c \
            daemon/xfer/offer.c daemon/xfer/fetch.c daemon/xfer/sched.c \
            daemon/xfer/end.c daemon/xfer/xfer_list.c \
            daemon/xfer/batch.c daemon/xfer/serve.c daemon/agree/agree.c \
            daemon/remote/slots.c daemon/remote/pull.c daemon/remote/source.c \
            daemon/remote/remote.c daemon/remote/release.c daemon/remote/keyed.c \
            daemon/local/session.c daemon/local/session_pool.c \
            daemon/local/session_conn.c \
            daemon/local/server.c daemon/local/stats.c \
            daemon/local/metrics.c daemon/local/http.c daemon/local/pacing.c \
            $(GPU_SRC)

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
PB_OBJ     := $(BUILD)/obj/gen/kvxfer.pb-c.o
CLIENT_OBJ := $(call obj,$(CLIENT)) $(PB_OBJ)
DAEMON_OBJ := $(call obj,$(DAEMON)) $(PB_OBJ) $(GPU_OBJ)

BINS := $(BUILD)/kvxferd $(BUILD)/kvxferctl $(BUILD)/kvxfer-bench \
        $(BUILD)/libkvxfer.so $(BUILD)/libkvxfer.a

UNIT_TESTS := $(patsubst tests/unit/%.c,$(BUILD)/tests/%,$(wildcard tests/unit/test_*.c))
ITEST      := $(BUILD)/tests/integration

.PHONY: all deps test asan tsan demo demo-gpu demo-router install uninstall clean bundle help test-gpu lint fuzz
.PHONY: check-lib test-python test-vllm test-sglang test-trtllm wheel print-daemon-src
all: $(BINS)

help:
	@echo "make            build $(BINS)"
	@echo "make test       install missing packages, build, run every test"
	@echo "make UCX=wheel  build against PyPI's libucx-cu13 (CUDA) in build-ucx-wheel; UCX=/prefix: a site UCX"
	@echo "make test-ucx-wheel  the C tests against PyPI's libucx-cu13 (make test-c: this UCX's)"
	@echo "make asan       the tests under ASan+UBSan"
	@echo "make tsan       the tests under ThreadSanitizer (host-only build)"
	@echo "make demo       install missing packages, build, run the end-to-end demo"
	@echo "make test-gpu   GPU tests (skips without a GPU)"
	@echo "make demo-gpu   a real transformer disaggregated through kvxfer (GPU), and the router"
	@echo "make demo-router  examples/router.py on the CPU: prefill and decode servers, checked (installs CPU torch)"
	@echo "make test-python  the Python package's tests (pytest, a venv under build/)"
	@echo "make test-vllm  kvxfer.vllm against vLLM's own scheduler (pinned vLLM, a venv)"
	@echo "make test-sglang  kvxfer.sglang against SGLang 0.5.23's base classes (a venv under build/)"
	@echo "make test-trtllm  kvxfer.trtllm against a stand-in TensorRT-LLM (torch: test-vllm's venv)"
	@echo "make wheel      dist/kvxfer-*.whl (manylinux): the package, kvxferd, kvxferctl, what they need"
	@echo "make test-wheel  make wheel, then a node from it alone in a fresh venv, unprivileged"
	@echo "make install    install under \$$DESTDIR\$$PREFIX"
	@echo "make check-lib  libkvxfer exports only kvx_*; installs; links via pkg-config"
	@echo "make check-units  systemd-analyze verify and security on the installed units"
	@echo "make check-man  the man pages render and kvxferd.yaml(5) is current"
	@echo "make check-docs  docs name current versions and live links; their snippets run"
	@echo "make deb        Debian packages in dist/deb (scripts/deps.sh deb: what it needs)"
	@echo "make test-deb   make deb, then install, run and purge them in a fresh Debian root"
	@echo "make check-k8s  deploy/kubernetes/ against the Kubernetes schemas and kvxfer's rules"
	@echo "make check-dockerfile  hadolint on the Dockerfile"
	@echo "make test-container  the Dockerfile built by buildah, its daemon run and checked"
	@echo "make lint       cppcheck, layers (scripts/layers.py), signatures (scripts/params.py)"
	@echo "make format-check  clang-format on the lines changed since origin/main (else HEAD~1)"
	@echo "make fuzz       libFuzzer targets, FUZZ_SECONDS each (clang)"

deps:
	@scripts/deps.sh
ifeq ($(UCX),wheel)
	@scripts/ucx-wheel.sh $(UCX_WHEEL_DIR)

# the wheel's UCX, fetched again when the script's version changes
$(UCX_DEP): scripts/ucx-wheel.sh
	@scripts/ucx-wheel.sh $(UCX_WHEEL_DIR)
endif

# kvxferd --version names the UCX it was built against
$(BUILD)/obj/daemon/main.o: CFLAGS += -DKVX_UCX_BUILT='"$(UCX_VERSION)"'

$(BUILD)/gen/kvxfer.pb-c.c $(BUILD)/gen/kvxfer.pb-c.h: proto/kvxfer.proto
	@mkdir -p $(BUILD)/gen
	protoc-c --c_out=$(BUILD)/gen --proto_path=proto proto/kvxfer.proto

$(BUILD)/obj/gen/kvxfer.pb-c.o: $(BUILD)/gen/kvxfer.pb-c.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Wno-unused-parameter -c $< -o $@

$(BUILD)/obj/%.o: %.c $(GEN) | $(UCX_DEP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)

$(BUILD)/obj/tools/bench_gpu.o: tools/bench_gpu.cu tools/bench_gpu.h tools/bench_pattern.h client/include/kvxfer.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -I. -Iclient/include -c $< -o $@

$(BUILD)/obj/daemon/copy/gpu_kernel.o: daemon/copy/gpu_kernel.cu daemon/copy/gpu_desc.h \
                                     daemon/copy/gpu_walk.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -Idaemon -c $< -o $@

$(BUILD)/libkvxfer.a: $(CLIENT_OBJ)
	rm -f $@; ar rcs $@ $^

# The library shows only its API (STYLE.md habit 13): its objects are
# compiled with hidden visibility, kvxfer.h marks the API KVX_EXPORT and
# the version script keeps everything else local (check: make check-lib).
# The real file carries the version of kvxfer.h, its soname the ABI's
# number (KVX_ABI_MAJOR: 3.0 kept 2, docs/operations.md says why);
# libkvxfer.so.2 (what the loader opens) and libkvxfer.so (what -lkvxfer
# finds) are links to it, here as after make install.
KVX_VERSION := $(shell sed -n 's/^.define KVX_VERSION_STRING "\(.*\)"/\1/p' client/include/kvxfer.h)
KVX_ABI := $(shell sed -n 's/^.define KVX_ABI_MAJOR \([0-9]*\)/\1/p' client/include/kvxfer.h)
SO_REAL := libkvxfer.so.$(KVX_VERSION)
SO_NAME := libkvxfer.so.$(KVX_ABI)
$(CLIENT_OBJ): CFLAGS += -fvisibility=hidden

$(BUILD)/$(SO_REAL): $(CLIENT_OBJ) client/libkvxfer.map
	$(CC) -shared $(LDFLAGS) -Wl,-soname,$(SO_NAME) \
	    -Wl,--version-script=client/libkvxfer.map -o $@ $(CLIENT_OBJ) $(LIBS)

$(BUILD)/$(SO_NAME): $(BUILD)/$(SO_REAL)
	ln -sf $(SO_REAL) $@

$(BUILD)/libkvxfer.so: $(BUILD)/$(SO_NAME)
	ln -sf $(SO_NAME) $@

$(BUILD)/kvxferd: $(DAEMON_OBJ) $(BUILD)/obj/daemon/main.o
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS) $(DAEMON_LIBS) $(CUDA_LIBS)

$(BUILD)/kvxferctl: $(BUILD)/obj/tools/kvxferctl.o $(BUILD)/obj/daemon/copy/plan.o $(BUILD)/libkvxfer.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

$(BUILD)/kvxfer-bench: $(BENCH_OBJ) $(BENCH_GPU_OBJ) $(BUILD)/libkvxfer.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS) -lm $(CUDA_LIBS)

# kill -9 of the daemon under two ranks, 20 times: socket ready to a
# verified transfer (scripts/restart_bench.sh, docs/benchmarks.md)
$(BUILD)/restart_bench: $(BUILD)/obj/tools/restart_bench.o $(BUILD)/libkvxfer.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

.PHONY: restart-bench
restart-bench: all $(BUILD)/restart_bench
	@scripts/restart_bench.sh $(BUILD)

# gpu.copy_path auto's walk of a 2 GiB launch on the loop: one walk
# against the two it took (tools/walk_bench.c, docs/benchmarks.md)
$(BUILD)/walk_bench: $(BUILD)/obj/tools/walk_bench.o \
		$(BUILD)/obj/daemon/copy/plan.o $(BUILD)/obj/daemon/copy/gpu_desc.o \
		$(BUILD)/libkvxfer.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

.PHONY: walk-bench
walk-bench: $(BUILD)/walk_bench
	@$(BUILD)/walk_bench

# The benches and the C tests still call the 2.x kvx_publish/kvx_fetch
# (kvxfer.h's KVX_API_2X; the tests reach the 3.0 calls as kvx_publish3
# and kvx_fetch3)
API_2X := -DKVX_API_2X
$(BENCH_OBJ): private CFLAGS += $(API_2X)
$(ITEST) $(BUILD)/tests/gpu: private CFLAGS += $(API_2X)

# Unit tests include the module's .c (to reach statics) and link the rest
# of the daemon except main.o and what a "unit-exclude:" line replaces
# (tests/unit/stub_net.c stands in for net).
$(BUILD)/tests/test_%: tests/unit/test_%.c tests/test.h $(wildcard tests/unit/*.h) tests/unit/stub_net.c $(DAEMON_OBJ) $(BUILD)/libkvxfer.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(filter-out $(call obj,$(shell sed -n 's|^#include "\.\./\.\./\(.*\.c\)"|\1|p; s|^ \* unit-exclude: \(.*\)$$|\1|p' $<)),$(DAEMON_OBJ)) $(LDFLAGS) $(LIBS) $(DAEMON_LIBS) $(CUDA_LIBS)

$(ITEST): tests/integration/integration.c $(filter-out %/fake_peer.c %/ucx_closes.c,$(wildcard tests/integration/*.c)) tests/test.h $(BUILD)/libkvxfer.a $(BUILD)/tests/fake_peer $(BUILD)/tests/libucx_closes.so
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(BUILD)/libkvxfer.a $(LDFLAGS) $(LIBS)

# preloaded into the daemons of peer tests that check each UCX endpoint
# is closed once
# (no sanitizer: preloaded ahead of an ASan daemon's runtime, which the
# daemon is then told to accept, it must not need that runtime itself)
$(BUILD)/tests/libucx_closes.so: tests/integration/ucx_closes.c | $(UCX_DEP)
	@mkdir -p $(dir $@)
	$(CC) $(filter-out $(SAN),$(CFLAGS)) -shared -o $@ $< $(DAEMON_LIBS)

# a daemon without the cluster secret, for the peer tests (UCX)
$(BUILD)/tests/fake_peer: tests/integration/fake_peer.c $(PB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(PB_OBJ) $(LDFLAGS) $(LIBS) $(DAEMON_LIBS)

# the C tests, then the Python package's (scripts/test-python.sh)
test: deps
	@$(MAKE) --no-print-directory all $(UNIT_TESTS) $(ITEST)
	@BUILD=$(BUILD) KVX_PYTHON_TESTS=1 tests/run.sh

# The C tests (unit, integration) against PyPI's UCX, in build-ucx-wheel;
# .ci/run runs them. `make test UCX=wheel` adds the Python package's.
.PHONY: test-ucx-wheel
test-ucx-wheel: deps
	@$(MAKE) --no-print-directory UCX=wheel BUILD=build-ucx-wheel test-c

# the C tests of this UCX and BUILD
.PHONY: test-c
test-c: deps
	@$(MAKE) --no-print-directory all $(UNIT_TESTS) $(ITEST)
	@BUILD=$(BUILD) tests/run.sh

# python/tests with pytest against this build's kvxferd and libkvxfer;
# pytest and numpy go into a virtual environment, $(BUILD)/venv
test-python: deps
	@$(MAKE) --no-print-directory all
	@scripts/test-python.sh $(BUILD)

# kvxfer.vllm driven by vLLM's Scheduler, factory and model-runner mixin
# (tests/vllm), vLLM installed from PyPI at the version kvxfer.vllm pins
# into $(BUILD)/venv-vllm without its GPU packages (the first run: about
# 4 minutes, 3.8 GB)
test-vllm: deps
	@$(MAKE) --no-print-directory all
	@scripts/test-python.sh $(BUILD) --vllm

# tests/sglang: kvxfer.sglang driven as SGLang's scheduler drives it,
# against the pinned SGLang's base classes in $(BUILD)/venv-sglang
test-sglang: deps
	@$(MAKE) --no-print-directory all
	@scripts/test-sglang.sh $(BUILD)

# tests/trtllm: kvxfer.trtllm's transceiver driven as TensorRT-LLM's
# executor drives one, against a stand-in written from its source
# (tests/trtllm/standin.py), in $(BUILD)/venv-vllm (torch and pytest)
test-trtllm: deps
	@$(MAKE) --no-print-directory all
	@scripts/test-python.sh $(BUILD) --trtllm

# A wheel a GPU node can use alone (scripts/wheel.sh): the Python
# package, libkvxfer.so.2, kvxferd, kvxferctl and kvxfer-bench, the
# libraries they need grafted by auditwheel (manylinux), depending on
# PyPI's libucx-cu13 for UCX; so built with UCX=wheel (build-ucx-wheel)
# whatever UCX= says. make test-wheel installs it into a fresh venv and
# runs a node from it (scripts/test-wheel.sh).
.PHONY: test-wheel
wheel:
	@$(MAKE) --no-print-directory UCX=wheel BUILD=build-ucx-wheel all
	@scripts/wheel.sh build-ucx-wheel dist

test-wheel: wheel
	@scripts/test-wheel.sh dist build/ucx-wheel/libucx/lib

asan:
	@scripts/deps.sh
	@$(MAKE) --no-print-directory BUILD=build-asan OPT=-O1 \
	    SAN="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" \
	    all build-asan/tests/integration \
	    $(patsubst $(BUILD)/%,build-asan/%,$(UNIT_TESTS))
	@BUILD=build-asan ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 \
	    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 tests/run.sh

# ThreadSanitizer over the same tests (host-only build). UCX's memory
# hooks crash under TSAN at thread exit, so they are off for the run.
tsan:
	@scripts/deps.sh
	@$(MAKE) --no-print-directory BUILD=build-tsan CUDA=0 OPT=-O1 \
	    SAN="-fsanitize=thread -fno-omit-frame-pointer" \
	    all build-tsan/tests/integration \
	    $(patsubst $(BUILD)/%,build-tsan/%,$(UNIT_TESTS))
	@BUILD=build-tsan UCX_MEM_EVENTS=no UCX_MEM_MALLOC_HOOKS=no \
	    TSAN_OPTIONS=halt_on_error=1:exitcode=66 tests/run.sh

demo: deps
	@$(MAKE) --no-print-directory all
	@scripts/demo.sh $(BUILD)

# A real transformer disaggregated through kvxfer: prefill, transfer and
# decode times for a 4096-token prompt, then the router example once,
# checked against a colocated run (needs CUDA torch, transformers).
demo-gpu: deps
	@$(MAKE) --no-print-directory all
	@KVXFER_LIB=$(BUILD)/libkvxfer.so.2 python3 tests/gpu/real_model.py demo \
		--kvxferd $(BUILD)/kvxferd
	@if python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then \
		KVXFER_LIB=$(BUILD)/libkvxfer.so.2 PYTHONUNBUFFERED=1 python3 examples/router.py \
			--device cuda --check --kvxferd $(BUILD)/kvxferd; \
	else echo "router: skipped: no CUDA torch or no transformers"; fi

# The router example on the CPU (examples/router.py, docs/engines/
# router.md): by key and by params against a colocated run, and two
# failing decodes. Installs Debian's CPU torch where python3 has none.
demo-router: deps
	@$(MAKE) --no-print-directory all
	@scripts/demo-router.sh $(BUILD)

# GPU tests: need a CUDA build and a GPU; anything less skips, saying why.
GPU_TESTS := $(if $(filter 1,$(CUDA)),$(BUILD)/tests/gpu $(BUILD)/tests/libkvxtorch.so)

test-gpu: deps
	@$(MAKE) --no-print-directory all $(GPU_TESTS)
	@scripts/test-gpu.sh $(BUILD)

$(BUILD)/tests/gpu: tests/gpu/gpu.c tests/test.h $(BENCH_GPU_OBJ) $(BUILD)/libkvxfer.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -o $@ $< $(BENCH_GPU_OBJ) $(BUILD)/libkvxfer.a $(LDFLAGS) $(LIBS) $(CUDA_LIBS)

# what tests/gpu/torch_pools.py calls through ctypes
$(BUILD)/tests/libkvxtorch.so: tests/gpu/torch_shim.c $(BUILD)/libkvxfer.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -shared -o $@ $< $(BUILD)/libkvxfer.a $(LDFLAGS) $(LIBS)

# A relocatable tree for GPU nodes whose image lacks libuv, protobuf-c or
# libyaml: the binaries plus those libraries from Debian's packages, and
# the UCX built with (UCX=wheel or a site's: its libraries, modules and
# tools; Debian's: its libraries from its packages).
bundle: all $(GPU_TESTS)
	@scripts/bundle.sh $(BUILD) dist/kvxfer $(UCX_BUNDLE)

# The GNU directory variables (GNU make manual, "Variables for
# Installation Directories"), each settable on the command line. Under
# PREFIX unless set, except where PREFIX is /usr (a distribution's
# install: debian/rules): there the configuration goes to /etc and the
# units and sysusers.d file where pkg-config's systemd.pc says.
# LIBDIR is multiarch where the compiler names a tuple (Debian:
# lib/x86_64-linux-gnu, which ld.so.conf.d lists also under /usr/local).
MULTIARCH     ?= $(shell $(CC) -print-multiarch 2>/dev/null)
EXEC_PREFIX   ?= $(PREFIX)
BINDIR        ?= $(EXEC_PREFIX)/bin
LIBDIR        ?= $(EXEC_PREFIX)/lib$(if $(MULTIARCH),/$(MULTIARCH))
INCLUDEDIR    ?= $(PREFIX)/include
DATADIR       ?= $(PREFIX)/share
MANDIR        ?= $(DATADIR)/man
PKGCONFIGDIR  ?= $(LIBDIR)/pkgconfig
ifeq ($(PREFIX),/usr)
SYSCONFDIR    ?= /etc
SYSTEMD_PC    = $(shell pkg-config --variable=$(1) systemd 2>/dev/null)
SYSTEMDUNITDIR ?= $(or $(call SYSTEMD_PC,systemdsystemunitdir),/lib/systemd/system)
SYSUSERSDIR   ?= $(or $(call SYSTEMD_PC,sysusersdir),/usr/lib/sysusers.d)
else
SYSCONFDIR    ?= $(PREFIX)/etc
SYSTEMDUNITDIR ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR   ?= $(PREFIX)/lib/sysusers.d
endif
KVX_CONF      := $(SYSCONFDIR)/kvxfer/kvxferd.yaml
# man/: kvxferd(8), kvxferctl(1), kvxfer-bench(1), kvxferd.yaml(5)
MAN_PAGES     := $(wildcard man/*.1 man/*.5 man/*.8)

.PHONY: print-install-dirs
print-install-dirs:
	@echo BINDIR=$(BINDIR); echo LIBDIR=$(LIBDIR); echo INCLUDEDIR=$(INCLUDEDIR)
	@echo PKGCONFIGDIR=$(PKGCONFIGDIR); echo SYSCONFDIR=$(SYSCONFDIR)
	@echo SYSTEMDUNITDIR=$(SYSTEMDUNITDIR); echo SYSUSERSDIR=$(SYSUSERSDIR)
	@echo DATADIR=$(DATADIR); echo MANDIR=$(MANDIR)

install: all
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR) $(DESTDIR)$(PKGCONFIGDIR) \
	    $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(SYSTEMDUNITDIR) \
	    $(DESTDIR)$(SYSUSERSDIR) $(DESTDIR)$(DATADIR)/kvxfer/systemd \
	    $(DESTDIR)$(SYSCONFDIR)/kvxfer
	install -m 755 $(BUILD)/kvxferd $(BUILD)/kvxferctl $(BUILD)/kvxfer-bench $(DESTDIR)$(BINDIR)/
	install -m 644 $(BUILD)/libkvxfer.a $(DESTDIR)$(LIBDIR)/
	install -m 755 $(BUILD)/$(SO_REAL) $(DESTDIR)$(LIBDIR)/
	ln -sf $(SO_REAL) $(DESTDIR)$(LIBDIR)/$(SO_NAME)
	ln -sf $(SO_NAME) $(DESTDIR)$(LIBDIR)/libkvxfer.so
	install -m 644 client/include/kvxfer.h $(DESTDIR)$(INCLUDEDIR)/
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(KVX_VERSION)|g' \
	    -e 's|@LIBDIR@|$(LIBDIR)|g' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' \
	    client/kvxfer.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/kvxfer.pc
	sed -e 's|@BINDIR@|$(BINDIR)|g' -e 's|@KVX_CONF@|$(KVX_CONF)|g' \
	    -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' \
	    systemd/kvxferd.service > $(DESTDIR)$(SYSTEMDUNITDIR)/kvxferd.service
	chmod 644 $(DESTDIR)$(SYSTEMDUNITDIR)/kvxferd.service
	install -m 644 systemd/kvxferd.socket $(DESTDIR)$(SYSTEMDUNITDIR)/kvxferd.socket
	install -m 644 systemd/kvxfer.sysusers $(DESTDIR)$(SYSUSERSDIR)/kvxfer.conf
	install -m 644 systemd/kvxferd-mps.conf systemd/nvidia-mps.service \
	    $(DESTDIR)$(DATADIR)/kvxfer/systemd/
	for m in $(MAN_PAGES); do \
	    s=$${m##*.}; install -d $(DESTDIR)$(MANDIR)/man$$s; \
	    install -m 644 $$m $(DESTDIR)$(MANDIR)/man$$s/; done
	[ -e $(DESTDIR)$(KVX_CONF) ] || install -m 644 config/kvxferd.yaml $(DESTDIR)$(KVX_CONF)
	@# the unit's LoadCredential= needs the file: a random secret for this
	@# node (not under DESTDIR: a package must not carry one)
	[ -n "$(DESTDIR)" ] || [ -e $(SYSCONFDIR)/kvxfer/peer.secret ] || \
	    (umask 077; head -c 32 /dev/urandom > $(SYSCONFDIR)/kvxfer/peer.secret)

# libkvxfer exports only its API, and an install of it works through
# pkg-config (the install goes to a temporary directory)
check-lib: all
	@MAKE="$(MAKE)" scripts/check-lib.sh $(BUILD)

# Debian packages (debian/): kvxferd, libkvxfer2, libkvxfer-dev,
# kvxfer-tools in dist/deb, lintian-clean; scripts/test-deb.sh installs
# them in a fresh Debian root (make test-deb)
.PHONY: deb test-deb
deb:
	@scripts/deb.sh dist/deb

test-deb: deb
	@scripts/test-deb.sh dist/deb

# The container recipes (docs/operations.md, "Containers and Kubernetes"):
# deploy/kubernetes/ against the Kubernetes schemas and kvxfer's rules,
# then broken copies of it and of the Dockerfile, each of which must fail
# (scripts/check-deploy.sh; its tools from PyPI into $(BUILD)/venv-deploy);
# the Dockerfile by hadolint; the Dockerfile built by buildah (no Docker
# engine) and its image's daemon run and checked (scripts/test-container.sh)
.PHONY: check-k8s check-dockerfile test-container
check-k8s: $(BUILD)/kvxferd
	@BUILD=$(BUILD) scripts/check-deploy.sh k8s
	@BUILD=$(BUILD) scripts/check-deploy.sh selftest

check-dockerfile:
	@BUILD=$(BUILD) scripts/check-deploy.sh dockerfile

test-container:
	@scripts/test-container.sh

# the man pages render (man -l) and kvxferd.yaml(5) is current
.PHONY: check-man
check-man: $(BUILD)/kvxferd
	@scripts/check-man.sh $(BUILD)

# the docs match the code: versions, links and sections
# (scripts/check-docs.py, which must catch planted mistakes:
# scripts/test-check-docs.sh), examples/hello.c built through pkg-config
# against an install and run (scripts/test-hello.sh), the code blocks of
# README.md, docs/python.md and docs/engines/*.md run as written
# (scripts/test-doc-snippets.sh), docs/engines/vllm-two-nodes.md's
# daemons on one machine (scripts/test-two-nodes.sh)
.PHONY: check-docs
check-docs: all
	@python3 scripts/check-docs.py
	@scripts/test-check-docs.sh
	@MAKE="$(MAKE)" scripts/test-hello.sh $(BUILD)
	@scripts/test-doc-snippets.sh $(BUILD)
	@scripts/test-two-nodes.sh $(BUILD)

# the systemd units: systemd-analyze verify and security (at most 2.5)
.PHONY: check-units
check-units: all
	@MAKE="$(MAKE)" scripts/check-units.sh $(BUILD)

uninstall:
	rm -f $(DESTDIR)$(BINDIR)/kvxferd $(DESTDIR)$(BINDIR)/kvxferctl \
	    $(DESTDIR)$(BINDIR)/kvxfer-bench $(DESTDIR)$(LIBDIR)/libkvxfer.a \
	    $(DESTDIR)$(LIBDIR)/libkvxfer.so $(DESTDIR)$(LIBDIR)/$(SO_NAME) \
	    $(DESTDIR)$(LIBDIR)/$(SO_REAL) $(DESTDIR)$(PKGCONFIGDIR)/kvxfer.pc \
	    $(DESTDIR)$(INCLUDEDIR)/kvxfer.h \
	    $(DESTDIR)$(SYSTEMDUNITDIR)/kvxferd.service \
	    $(DESTDIR)$(SYSTEMDUNITDIR)/kvxferd.socket \
	    $(DESTDIR)$(SYSUSERSDIR)/kvxfer.conf \
	    $(DESTDIR)$(DATADIR)/kvxfer/systemd/kvxferd-mps.conf \
	    $(DESTDIR)$(DATADIR)/kvxfer/systemd/nvidia-mps.service \
	    $(foreach m,$(MAN_PAGES),$(DESTDIR)$(MANDIR)/man$(subst .,,$(suffix $(m)))/$(notdir $(m)))

# The daemon's sources, for tests/fuzz/build.sh (one list).
print-daemon-src:
	@echo $(DAEMON)

# libFuzzer targets (clang): every decoder, FUZZ_SECONDS each.
FUZZ_SECONDS ?= 30
fuzz: $(GEN)
	@tests/fuzz/build.sh
	@for t in frame request params config peer peer_auth; do \
	    mkdir -p build/fuzz/corpus-$$t; \
	    [ ! -d tests/fuzz/seeds-$$t ] || cp tests/fuzz/seeds-$$t/* build/fuzz/corpus-$$t/; \
	    echo "== fuzz_$$t, $(FUZZ_SECONDS) s"; \
	    build/fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -max_len=8192 \
	        build/fuzz/corpus-$$t $$([ $$t = config ] && echo config) \
	        > build/fuzz/$$t.log 2>&1 || { tail -n 40 build/fuzz/$$t.log; exit 1; }; \
	    grep "DONE" build/fuzz/$$t.log; \
	done

lint: $(GEN)
	cppcheck --quiet --error-exitcode=1 --enable=warning,performance,portability \
	    --std=c11 $(INCLUDES) -I$(BUILD)/gen daemon common client tools
	python3 scripts/layers.py
	python3 scripts/params.py

# clang-format (.clang-format) on changed lines only: the existing code
# is not fully formatted. BASE=<commit> to compare with another base.
.PHONY: format-check
format-check:
	@scripts/check-format.sh $(BASE)

clean:
	rm -rf build build-asan build-tsan build-ucx-wheel build-ucx-site build-deb dist
