#!/usr/bin/env bash
# `make image-test`: build the image and serve one completion from it, on a machine without a container engine
# and without registry access. Not part of `make test` (minutes, root, disk): run it after changing the
# Dockerfile, .dockerignore or the serving dependencies. Needs root (apt-get, mounts, chroot) and the default
# model (`make model`). Steps: podman + mmdebstrap from Debian, the base rootfs (base-rootfs.sh), the runtime
# image (build.sh), then the image's filesystem started by hand (smoke.py). Storage: $IMAGE_TEST_DIR
# (/var/tmp/appliance-image-test, ~1.5 GB with vfs; `rm -rf` it to start over).
set -euo pipefail
here=$(dirname "$0")
. "$here/lib.sh"
start=$SECONDS
if ! command -v podman >/dev/null || ! command -v mmdebstrap >/dev/null; then
	log "installing podman mmdebstrap (apt-get)"
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman mmdebstrap >/dev/null
fi
bash "$here/base-rootfs.sh"
bash "$here/build.sh"
t=$SECONDS
"${PYTHON:-$here/../.venv-dev/bin/python}" "$here/smoke.py"
podman_ image umount "$IMAGE_TAG" >/dev/null || true
log "image-test passed: build $((t - start))s, smoke $((SECONDS - t))s, image $(podman_ image inspect --format '{{.Size}}' "$IMAGE_TAG") bytes"
