# The afd-ctl daemon and its CLI: the image deploy/kubernetes names afd-ctl:latest.
#
#   docker build -f deploy/docker/afd-ctl.Dockerfile -t afd-ctl:latest .
#
# (from the repository root; .dockerignore keeps virtual environments and results out of the
# context). It installs through scripts/install_afd.sh, the script tests/test_install_script.py
# runs. Not built on the project's CI machines (no container runtime there): the install it
# runs is what the test checks.
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
