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
# g++ builds the C++ kernels here, with the package: a library per x86 CPU kind (shard/kernels/toolchain.py). The
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
    && python -c "from conveyor.shard.kernels import toolchain; assert (toolchain.BUILT / toolchain.MANIFEST).is_file()" \
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
    && mkdir /models /data \
    && chown conveyor:conveyor /models /data
USER conveyor
WORKDIR /home/conveyor
VOLUME /models /data
# 3000: HTTP (clients). 3001: the gRPC front door. Shard ports (--listen) are opened only when asked for. 80: HTTP
# when started as TGI's image was (flags alone, see below).
EXPOSE 3000 3001 80
# /health is 200 only while serving: 503 while starting, while shards are being restarted, and while draining.
# Slim images have no curl, hence Python; either HTTP port answering is healthy.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request as u\ndef ok(url):\n  try: return u.urlopen(url, timeout=4).status == 200\n  except OSError: return False\nsys.exit(not (ok('http://127.0.0.1:3000/health') or ok('http://127.0.0.1:80/health')))"]
# The entrypoint (launcher/image.py) runs a command as it is: the default below, or conveyor-router or
# conveyor-shard as compose names them. Flags alone (`docker run -p 8080:80 -v $volume:/data IMAGE --model-id ID`,
# as TGI's image was run) start the launcher on port 80, the Hub's cache in /data. It execs, so the launcher gets
# SIGTERM itself (it drains, then stops the shards); `docker run --init` adds a process to reap what it leaves.
ENTRYPOINT ["python", "-m", "conveyor.launcher.image"]
CMD ["conveyor-launcher", "--model-id", "demo", "--hostname", "0.0.0.0", "--port", "3000", "--grpc-port", "3001"]
