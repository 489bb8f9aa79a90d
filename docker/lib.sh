# Shared by the image-test scripts: one podman store for all of them, outside the checkout.
# No container engine runs here and `podman run` is refused by the sandbox's rlimits, so the scripts only build
# (chroot isolation, vfs storage: no overlay mounts, no user namespaces needed) and then chroot into the image.
IMAGE_TEST_DIR=${IMAGE_TEST_DIR:-/var/tmp/appliance-image-test}
BASE_TAG=${BASE_TAG:-localhost/appliance-base:bookworm}
IMAGE_TAG=${IMAGE_TAG:-localhost/appliance:test}
podman_() {
	podman --root "$IMAGE_TEST_DIR/storage" --runroot "$IMAGE_TEST_DIR/run" --storage-driver vfs "$@"
}
log() { printf '[image-test %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
