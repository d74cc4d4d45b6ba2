# slime for GPU nodes: the official SGLang CUDA image (SGLang, torch, flashinfer, sglang-router,
# torch_memory_saver), plus megatron-core, Transformer Engine, optionally Apex, and this project.
#
#   docker build -t slime .                                  # the pinned SGLang image below
#   docker build --build-arg SGLANG_TAG=v0.5.23 -t slime .   # another SGLang release
#
# v0.5.19-cu129 is the last SGLang release built on CUDA 12 (drivers >= 525 on H100); later tags
# need a CUDA 13 driver. Versions pinned here are checked against pyproject.toml by
# tests/unit/test_dockerfile.py.
ARG SGLANG_TAG=v0.5.19-cu129
FROM lmsysorg/sglang:${SGLANG_TAG}

ARG MEGATRON_CORE_VERSION=0.16.1
ARG TRANSFORMER_ENGINE_VERSION=2.9.0
ARG TORCH_MEMORY_SAVER_VERSION=0.0.10
# 1: build Transformer Engine's PyTorch extension against the image's torch (needs nvcc, ~20 min).
ARG INSTALL_TRANSFORMER_ENGINE=1
# An NVIDIA/apex git ref to build with its CUDA extensions; empty skips Apex (megatron-core uses
# Transformer Engine's fused kernels, Apex is only its fallback).
ARG APEX_REF=""

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/slime

# Every package the image ships stays at its version (torch, transformers and everything SGLang
# pins): the installs below are constrained to them, so nothing re-pulls another torch.
RUN python3 -m pip list --format=freeze > /opt/image-constraints.txt \
    && python3 -m pip install --no-cache-dir -c /opt/image-constraints.txt \
        "megatron-core==${MEGATRON_CORE_VERSION}" \
    && if ! python3 -c "import torch_memory_saver" 2>/dev/null; then \
        python3 -m pip install --no-cache-dir -c /opt/image-constraints.txt \
            "torch_memory_saver==${TORCH_MEMORY_SAVER_VERSION}"; \
    fi \
    && if [ "${INSTALL_TRANSFORMER_ENGINE}" = "1" ]; then \
        python3 -m pip install --no-cache-dir --no-build-isolation -c /opt/image-constraints.txt \
            "transformer_engine[pytorch]==${TRANSFORMER_ENGINE_VERSION}"; \
    fi \
    && if [ -n "${APEX_REF}" ]; then \
        APEX_CPP_EXT=1 APEX_CUDA_EXT=1 python3 -m pip install --no-cache-dir --no-build-isolation \
            -c /opt/image-constraints.txt "git+https://github.com/NVIDIA/apex.git@${APEX_REF}"; \
    fi

COPY . /opt/slime
RUN python3 -m pip install --no-cache-dir -c /opt/image-constraints.txt -e /opt/slime \
    && python3 -c "import megatron.core, sglang, slime.config; print('slime image ready')"

CMD ["python3", "train.py", "--help"]
