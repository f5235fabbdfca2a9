# moe-serve on a CUDA PyTorch base.
#
# Base image: pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime, i.e. torch 2.11.0+cu130, because
#  - it is the CUDA torch every GPU number in README.md and bench/results/ was measured with (the
#    result files record "torch": "2.11.0+cu130", on an H100 with driver 580);
#  - it is inside pyproject's torch range (>=2.5,<2.14), so `pip install` keeps it and adds only
#    the server's pure-Python dependencies: no second multi-GB CUDA torch in the image;
#  - "runtime", not "devel": nothing is compiled at build time, and Triton (shipped with this torch)
#    compiles the fused expert kernels at run time with its own bundled ptxas; devel adds GBs.
# CUDA 13.0 needs a host driver >= 580 and a GPU of compute capability 7.5 or newer (Turing to
# Blackwell). For an older driver (>= 570) build on the CUDA 12.8 build of the same torch:
#   docker build --build-arg BASE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime -t moe-serve .
#
#   docker build -t moe-serve .
#   docker run --gpus all -p 8000:8000 -v /models:/models:ro moe-serve \
#       --config olmoe-1b-7b-8gb --model /models/OLMoE-1B-7B-0924-Instruct
#
# CPU only (no GPU on the host): build on a plain Python base and install the README's CPU build
# of torch (2.13.0, what CI tests) before the project, so pip does not pull the CUDA wheels:
#   docker build --build-arg BASE=python:3.11-slim --build-arg TORCH_CPU=1 -t moe-serve:cpu .
#   docker run -p 8000:8000 -e OMP_NUM_THREADS=4 moe-serve:cpu --device cpu
# (set OMP_NUM_THREADS to the cores you give the container: torch's default thread pool
# oversubscribes a CPU it shares with the server process.)
ARG BASE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${BASE}

ARG TORCH_CPU=0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

RUN useradd --create-home --uid 1000 moe
WORKDIR /app

RUN if [ "$TORCH_CPU" = "1" ]; then pip install "torch==2.13.0" --index-url "$TORCH_CPU_INDEX"; fi

COPY pyproject.toml README.md ./
# One package: the server, the engine, the default model and its draft, the presets (package data,
# so a bare `moe-serve` serves the default model and `--config NAME` finds a preset).
COPY moe_serve ./moe_serve
RUN pip install . && chown -R moe:moe /app

USER moe
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s \
  CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
ENTRYPOINT ["moe-serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
