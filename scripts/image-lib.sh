# Sourced by scripts/images.sh, scripts/image-base.sh and scripts/image-test.sh: the image names
# and tags, and buildah/podman with the flags these machines need (TESTING.md, "Images"): vfs
# storage, chroot build isolation, runc and cgroupfs, ulimits no higher than the hard limits.
# Every variable can be overridden from the environment.
IMAGE_REGISTRY=${IMAGE_REGISTRY:-ghcr.io/sessionflow}
IMAGE_TAG=${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"$/\1/p' Cargo.toml | head -n1)}
WORKER_IMAGE=${WORKER_IMAGE:-$IMAGE_REGISTRY/sessionflow-worker:$IMAGE_TAG}
OPERATOR_IMAGE=${OPERATOR_IMAGE:-$IMAGE_REGISTRY/sessionflow-operator:$IMAGE_TAG}
# The runtime base the CI images sit on (scripts/image-base.sh): distroless/cc-debian12 rebuilt
# from the same Debian 12 packages, since no registry can be reached here.
BASE_IMAGE=${BASE_IMAGE:-localhost/sessionflow-base:cc-debian12}
IMAGE_CACHE=${IMAGE_CACHE:-$HOME/.cache/sessionflow}
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}
export BUILDAH_ISOLATION=${BUILDAH_ISOLATION:-chroot}

bah() { buildah --storage-driver "$STORAGE_DRIVER" "$@"; }
pod() {
  podman --storage-driver "$STORAGE_DRIVER" --runtime "${PODMAN_RUNTIME:-runc}" \
    --cgroup-manager cgroupfs "$@"
}
# `podman run` limits at or below the sandbox's hard limits (podman's defaults exceed them), and
# at most 16384: here runc could not set nproc 65536 although the hard limit was 96363.
pod_limits() {
  local n u
  n=$(ulimit -Hn); u=$(ulimit -Hu)
  [[ $n == unlimited ]] || ((n > 16384)) && n=16384
  [[ $u == unlimited ]] || ((u > 16384)) && u=16384
  echo "--ulimit nofile=$n:$n --ulimit nproc=$u:$u"
}
# Size of a local image in bytes, as the storage reports it.
image_bytes() { pod image inspect --format '{{.Size}}' "$1"; }
