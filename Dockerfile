# Conveyor's image (docs/deployment.md, "The image"). `make image` builds the CPU image; `make image-gpu` the GPU one.
#
#   docker run -p 3000:3000 -v conveyor-models:/models conveyor      serves the demo model on 0.0.0.0:3000
#
# Build arguments:
#   BASE_IMAGE       both stages; any image with Python 3.10+ and its venv module (the venv built in the first
#                    stage is copied into the second, so both must have the same Python at the same path)
#   TORCH_INDEX_URL  where torch comes from: the CPU wheels by default; https://pypi.org/simple gives PyPI's
#                    Linux build, which is a CUDA build that carries its own CUDA libraries (the host needs only
#                    the NVIDIA driver and container toolkit)
#   TORCH_VERSION    the torch the project is tested with
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# g++ builds the C++ kernels here, with the package: a library per x86 CPU kind (shard/kernels/compile.py). The
# image that runs has no compiler; each shard loads the library its CPU runs.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from its own index, so that `pip install .` finds it installed and pulls no other build; the kernels
# are built against it (no build isolation, which would fetch a torch of its own).
RUN pip install --upgrade pip && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
    && pip install "setuptools>=68" wheel
WORKDIR /src
COPY . .
RUN pip install --no-build-isolation . \
    && python -c "from conveyor.shard.kernels import compile; assert (compile.BUILT / compile.MANIFEST).is_file()" \
    && conveyor-launcher --help > /dev/null

FROM ${BASE_IMAGE}
COPY --from=builder /opt/venv /opt/venv
# CONVEYOR_CACHE: where `--model-id demo` is built on first use, and where model directories are mounted.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    CONVEYOR_CACHE=/models \
    HF_HUB_OFFLINE=1
# No compiler: the kernels came built with the package. libgomp1 is OpenMP's runtime, which they link (torch's own
# copy serves them once torch is loaded; the system's is there for a torch build that names its copy otherwise).
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 1000 --user-group conveyor \
    && mkdir /models \
    && chown conveyor:conveyor /models
USER conveyor
WORKDIR /home/conveyor
VOLUME /models
# 3000: HTTP (clients). 3001: the gRPC front door. Shard ports (--listen) are opened only when asked for.
EXPOSE 3000 3001
# /health is 200 only while serving: 503 while starting, while shards are being restarted, and while draining.
# Slim images have no curl, hence Python.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:3000/health', timeout=4).status != 200)"]
# No ENTRYPOINT: the command names the console script, so one image runs conveyor-launcher, conveyor-router or
# conveyor-shard. The launcher handles SIGTERM itself (it drains, then stops the shards); `docker run --init`
# adds a process to reap anything it leaves.
CMD ["conveyor-launcher", "--model-id", "demo", "--hostname", "0.0.0.0", "--port", "3000", "--grpc-port", "3001"]
