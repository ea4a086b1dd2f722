# ghostgpu: one image for the collector and the node tracer (see deploy/kubernetes/ghostgpu.yaml).
#   docker build -t ghostgpu:0.1.0 .
# The tracer compiles its BPF programs with bcc at start against the node's kernel headers, which the
# DaemonSet mounts from the host (/lib/modules, /usr/src); it reads only tracepoint arguments, so
# headers of the same kernel series are enough (README, Quick start).
FROM debian:bookworm-slim

# python3-bpfcc is bcc for Debian's /usr/bin/python3; the venv below sees it (system site packages).
# apt-get clean: the .debs (~140 MB, mostly LLVM for bcc) must not stay in the layer on a base image
# without the official images' docker-clean apt hook.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv python3-bpfcc ca-certificates \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/*

COPY pyproject.toml README.md /src/
COPY bpf /src/bpf
COPY ghostgpu /src/ghostgpu
COPY tracer /src/tracer
COPY collector /src/collector
COPY cli /src/cli
# A wheel install, not editable: bpf/*.bpf.c go to share/ghostgpu/bpf (pyproject data-files), where
# tracer/bpf_build.py finds them.
RUN python3 -m venv --system-site-packages /opt/ghostgpu \
 && /opt/ghostgpu/bin/pip install --no-cache-dir /src \
 && rm -rf /src

ENV PATH=/opt/ghostgpu/bin:$PATH PYTHONUNBUFFERED=1
ENTRYPOINT ["ghostgpu"]
CMD ["--help"]
