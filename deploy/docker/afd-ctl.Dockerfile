# The afd-ctl daemon and its CLI: the image deploy/kubernetes names afd-ctl:0.1.0 (the
# project's version, pyproject.toml; a fixed tag, so Kubernetes' default imagePullPolicy is
# IfNotPresent and an image loaded onto the nodes is used as it is). From the repository root:
#
#   docker build -f deploy/docker/afd-ctl.Dockerfile -t afd-ctl:0.1.0 .
#
# (.dockerignore keeps virtual environments and results out of the context). A slim Python and
# afd-ctl only: no vLLM, no NIXL, no torch. It installs through scripts/install_afd.sh, the
# script tests/test_install_script.py runs for real. Never built on the project's machines:
# they have no Docker daemon (the docker CLI there cannot build), so the install this image
# runs is what the test checks, and tests/test_images.py that the tags here, in the manifests
# and in the README agree.
ARG PYTHON_IMAGE=python:3.12-slim
FROM ${PYTHON_IMAGE}

COPY . /src
RUN bash /src/scripts/install_afd.sh daemon python3 \
    && rm -rf /src /root/.cache \
    && useradd --uid 65532 --no-create-home --shell /usr/sbin/nologin afd

# Non-root, and nothing to write: the daemon keeps its state in memory.
USER 65532:65532
EXPOSE 50051 9100
ENTRYPOINT ["afd-ctl"]
CMD ["serve", "--listen", "0.0.0.0:50051"]
