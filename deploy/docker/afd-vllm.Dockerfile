# vLLM with the AFD plugin (both roles: `vllm serve --afd-role attention|ffn`, and the PD
# overlay's router): the image deploy/kubernetes names afd-vllm:0.1.0 (the project's version,
# pyproject.toml). Built on vLLM's own image, so vLLM, torch and CUDA are exactly what vLLM
# ships; this adds the project and NIXL. From the repository root:
#
#   docker build -f deploy/docker/afd-vllm.Dockerfile -t afd-vllm:0.1.0 .
#   docker build -f deploy/docker/afd-vllm.Dockerfile --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.32.0 -t afd-vllm:0.1.0-vllm0.32 .
#
# VLLM_IMAGE must hold a supported vLLM line: 0.26 (the default, the line the H200 machines
# run, torch 2.11 / CUDA 13) or 0.32 (name its tag in your overlay's kustomize `images:`); the
# install refuses any other. It installs through scripts/install_afd.sh, the script
# tests/test_install_script.py runs for real. Never built on the project's machines: they have
# no Docker daemon and no GPU, so the install this image runs is what the test checks, and
# tests/test_images.py that the tags here, in the manifests and in the README agree.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.26.0
FROM ${VLLM_IMAGE}

COPY . /src
RUN bash /src/scripts/install_afd.sh plugin python3 \
    && rm -rf /src /root/.cache \
    && useradd --uid 10001 --create-home --home-dir /home/afd --shell /usr/sbin/nologin afd

# Non-root. vLLM writes its caches (torch.compile, Triton, the weights digest of
# vllm_ext.weights_digest) under $HOME/.cache and temporary files under /tmp: the manifests
# mount emptyDirs at both, so the root filesystem can stay read-only.
USER 10001:10001
ENV HOME=/home/afd
WORKDIR /home/afd
EXPOSE 8000 9400
ENTRYPOINT ["vllm"]
