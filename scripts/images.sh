#!/usr/bin/env bash
# `make images`: builds the worker and operator images, tagged $IMAGE_REGISTRY/sessionflow-
# {worker,operator}:$IMAGE_TAG (default ghcr.io/sessionflow, the workspace version = the chart's
# appVersion), with OCI labels for the version and the source revision.
#
# Why two paths: with a Docker engine (`docker info` answers), `docker build` compiles inside the
# Dockerfiles' builder stage, from rust:1.95-bookworm, onto distroless — what users and releases
# run. Without one (these machines, CI), buildah does it: the release binaries are built ONCE on
# the host with `cargo auditable` (target dir cached under ~/.cache/sessionflow/image-target),
# checked against the libraries distroless/cc-debian12 has, and packaged with the same
# Dockerfiles' `prebuilt` target onto the base scripts/image-base.sh makes from Debian packages.
#
#   IMAGE_ENGINE=docker|buildah   force a path (default: docker when it answers, else buildah)
#   IMAGE_REGISTRY, IMAGE_TAG     image names (see scripts/image-lib.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/image-lib.sh
CARGO=${CARGO:-cargo}
VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [[ $REVISION != unknown ]] && [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]]; then
  REVISION=$REVISION-dirty
fi
engine=${IMAGE_ENGINE:-}
if [[ -z $engine ]]; then
  if docker info >/dev/null 2>&1; then engine=docker; else engine=buildah; fi
fi

if [[ $engine == docker ]]; then
  for c in worker operator; do
    image=$WORKER_IMAGE; [[ $c == operator ]] && image=$OPERATOR_IMAGE
    docker build -f "Dockerfile.$c" --build-arg VERSION="$VERSION" \
      --build-arg REVISION="$REVISION" -t "$image" .
  done
  exit 0
fi

command -v buildah >/dev/null || {
  echo "images: neither a Docker engine nor buildah (apt-get install buildah podman runc)" >&2
  exit 1
}

# cargo-auditable: records the dependency list in each binary.
export PATH=$IMAGE_CACHE/tools/bin:$PATH
if ! "$CARGO" auditable --version >/dev/null 2>&1; then
  echo "== images: installing cargo-auditable"
  "$CARGO" install cargo-auditable --locked --version 0.7.7 --root "$IMAGE_CACHE/tools"
fi

# One release build per binary (each with its own features, as the Dockerfile's builder has them);
# dependencies are shared between them and cached across runs. The worker image holds two: the
# stage (`sessionflow-worker`) and the tools (`sessionflow`, crate sessionflow-tools).
target=${IMAGE_TARGET_DIR:-$IMAGE_CACHE/image-target}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for spec in worker:worker:sessionflow-worker worker:tools:sessionflow operator:operator:sessionflow-operator; do
  IFS=: read -r c pkg bin <<<"$spec"
  echo "== images: cargo auditable build --release -p sessionflow-$pkg --bin $bin"
  CARGO_TARGET_DIR=$target LIBZ_SYS_STATIC=1 "$CARGO" auditable build --release --locked \
    -p "sessionflow-$pkg" --bin "$bin"
  mkdir -p "$work/$c"
  install -m 0755 "$target/release/$bin" "$work/$c/$bin"
  strip --strip-debug "$work/$c/$bin"
  # The same check as the Dockerfile's builder stage: only libraries distroless/cc-debian12 has.
  extra=$(ldd "$work/$c/$bin" | awk '{print $1}' |
    grep -vE '^(linux-vdso\.so|/lib.*/ld-linux|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libgcc_s\.so|libstdc\+\+\.so|libgomp\.so|libssl\.so\.3|libcrypto\.so\.3)' ||
    true)
  if [[ -n $extra ]]; then
    echo "images: $bin needs libraries distroless/cc-debian12 lacks: $extra" >&2
    exit 1
  fi
done

scripts/image-base.sh
for c in worker operator; do
  image=$WORKER_IMAGE; [[ $c == operator ]] && image=$OPERATOR_IMAGE
  echo "== images: $image"
  old=$(bah inspect --type image --format '{{.FromImageID}}' "$image" 2>/dev/null || true)
  bah bud --quiet --isolation chroot --pull=never --layers=false -f "$PWD/Dockerfile.$c" \
    --target prebuilt --build-arg RUNTIME_IMAGE="$BASE_IMAGE" \
    --build-arg VERSION="$VERSION" --build-arg REVISION="$REVISION" \
    -t "$image" "$work/$c" >/dev/null
  # The image this tag named before: vfs keeps a full copy of each, so drop it.
  if [[ -n $old ]] && [[ $old != "$(bah inspect --type image --format '{{.FromImageID}}' "$image")" ]]; then
    bah rmi "$old" >/dev/null 2>&1 || true
  fi
done
for image in "$WORKER_IMAGE" "$OPERATOR_IMAGE"; do
  bytes=$(image_bytes "$image")
  awk -v i="$image" -v b="$bytes" 'BEGIN { printf "images: %s %d bytes (%.1f MB)\n", i, b, b / 1e6 }'
done
