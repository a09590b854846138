# kvxferd, the per-node KV cache transfer daemon, as a container image:
# docs/operations.md, "Containers and Kubernetes", says how to build and
# run it (and deploy/kubernetes/ as a DaemonSet).
#
#   docker build -t kvxferd .                       (CUDA: GPU pools)
#   docker build --build-arg CUDA=none -t kvxferd . (host pools only)
#
# Stage 1 builds the Debian packages (make deb) on Debian, with the CUDA
# toolkit from NVIDIA's Debian repository unless CUDA=none (nvcc on PATH
# gives the daemon its GPU data plane; the CUDA runtime is linked in
# statically, and the driver, libcuda.so.1, comes from the node through
# the NVIDIA container runtime). Stage 2 installs kvxferd and
# kvxfer-tools into debian:*-slim and runs the daemon as the
# unprivileged user kvxfer, whose uid and gid are fixed (KVX_UID,
# KVX_GID) so that engine containers can join its group.
ARG DEBIAN=bookworm

FROM debian:${DEBIAN} AS build
# CUDA: the toolkit's package suffix (12-8: CUDA 12.8, the oldest that
# builds the sm_100 kernels) or none; CUDA_REPO: NVIDIA's repository for
# this Debian release
ARG CUDA=12-8
ARG CUDA_REPO=debian12
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
# what debian/control's Build-Depends name, and what make deb runs
# (lintian), then the CUDA toolkit; Debian's versions are not pinned: the
# release's security updates come in
COPY debian/control debian/control
# hadolint ignore=DL3008
RUN apt-get update && \
    apt-get install -y --no-install-recommends build-essential lintian && \
    apt-get build-dep -y --no-install-recommends ./ && \
    if [ "$CUDA" != none ]; then \
        apt-get install -y --no-install-recommends ca-certificates curl && \
        curl -fsSLo /tmp/cuda-keyring.deb \
            "https://developer.download.nvidia.com/compute/cuda/repos/$CUDA_REPO/x86_64/cuda-keyring_1.1-1_all.deb" && \
        dpkg -i /tmp/cuda-keyring.deb && apt-get update && \
        apt-get install -y --no-install-recommends "cuda-minimal-build-$CUDA" && \
        { [ -e /usr/local/cuda ] || ln -s "/usr/local/cuda-${CUDA/-/.}" /usr/local/cuda; }; \
    fi && \
    rm -rf /var/lib/apt/lists/*
# (the Makefile takes the nvcc it finds on PATH)
ENV PATH=/usr/local/cuda/bin:$PATH
COPY . .
RUN make deb

FROM debian:${DEBIAN}-slim
ARG KVX_UID=10001
ARG KVX_GID=10001
COPY --from=build /src/dist/deb/kvxferd_*.deb /src/dist/deb/kvxfer-tools_*.deb /tmp/debs/
# The user first, with its fixed ids: the package's postinst then keeps
# it. The package's random peer.secret goes: one baked into an image
# would be every container's; the cluster's secret is mounted instead.
# /run/kvxfer (the socket's directory, a volume) and /var/lib/kvxfer are
# the daemon's.
RUN groupadd --system --gid "$KVX_GID" kvxfer && \
    useradd --system --uid "$KVX_UID" --gid kvxfer --no-create-home \
        --home-dir /var/lib/kvxfer --shell /usr/sbin/nologin \
        --comment "kvxfer KV cache transfer daemon" kvxfer && \
    apt-get update && \
    apt-get install -y --no-install-recommends /tmp/debs/*.deb && \
    rm -rf /var/lib/apt/lists/* /tmp/debs /etc/kvxfer/peer.secret && \
    install -d -o kvxfer -g kvxfer -m 0750 /run/kvxfer /var/lib/kvxfer
# every GPU of the node, for the NVIDIA container runtime: the daemon
# finds each pool's GPU by UUID among those it sees
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER ${KVX_UID}:${KVX_GID}
VOLUME ["/run/kvxfer"]
# /metrics and /health, where metrics.listen names this port
EXPOSE 9464
# kvxferctl health: 0 while the loop turns, 1 while it drains or lags,
# or when the daemon does not answer (docs/operations.md, "Metrics and
# health")
HEALTHCHECK --interval=10s --timeout=6s --start-period=10s --retries=3 \
    CMD ["kvxferctl", "health"]
# SIGTERM drains (deadlines.drain_timeout_ms, 5 s) and exits 0
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvxferd"]
CMD ["--config", "/etc/kvxfer/kvxferd.yaml"]
