#!/usr/bin/env bash
# The Dockerfile's base made from Debian packages, because no registry image can be pulled here: a bookworm
# rootfs (mmdebstrap, minbase) with Debian's python3 (3.11, as the python:3.11-slim-bookworm the Dockerfile pins),
# its venv module and `python` on PATH, imported into podman as $BASE_TAG. `make image-test` builds the Dockerfile
# with --build-arg BASE_IMAGE=$BASE_TAG. Reused if the tag exists (--force rebuilds).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
if [[ "${1:-}" != --force ]] && podman_ image exists "$BASE_TAG"; then
	log "base $BASE_TAG exists"
	exit 0
fi
mkdir -p "$IMAGE_TEST_DIR"
tarball="$IMAGE_TEST_DIR/base.tar"
log "mmdebstrap bookworm -> $tarball"
mmdebstrap --quiet --variant=minbase \
	--include=python3,python3-venv,python-is-python3,ca-certificates \
	--aptopt='Acquire::Languages "none"' --dpkgopt='path-exclude=/usr/share/doc/*' \
	--dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
	bookworm "$tarball"
podman_ import --change 'CMD ["python3"]' "$tarball" "$BASE_TAG" >/dev/null
rm -f "$tarball"
log "base $BASE_TAG: $(podman_ image inspect --format '{{.Size}}' "$BASE_TAG") bytes"
