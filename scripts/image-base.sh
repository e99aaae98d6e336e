#!/usr/bin/env bash
# Builds the runtime base image of the CI images, localhost/sessionflow-base:cc-debian12, when no
# registry can be reached (no `gcr.io/distroless/cc-debian12:nonroot` to pull).
#
# Why this exists: the published images sit on distroless/cc-debian12:nonroot (Dockerfile.*,
# build argument RUNTIME_IMAGE). Distroless is made of a handful of Debian 12 packages unpacked
# into an empty image; this script does the same from this machine's Debian mirror, so the
# image test runs the binaries on the same libraries they get in production:
#   base-files netbase tzdata ca-certificates        (distroless/static)
#   libc6 libssl3                                      (distroless/base)
#   libgcc-s1 libgomp1 libstdc++6                      (distroless/cc)
# plus /etc/passwd and /etc/group with `nonroot` (65532), /etc/nsswitch.conf, /home/nonroot, /tmp, the CA bundle
# (/etc/ssl/certs/ca-certificates.crt, made from the ca-certificates package as
# update-ca-certificates would) and SSL_CERT_FILE, as distroless has them. No shell, no package
# manager. Documentation, manual pages, locales and glibc's iconv modules are left out.
#
# Idempotent: does nothing when the image exists (FORCE=1 rebuilds it). The .debs are cached
# under ~/.cache/sessionflow/image-base.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/image-lib.sh

if [[ -z ${FORCE:-} ]] && bah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
  echo "image-base: $BASE_IMAGE exists"
  exit 0
fi

packages=(base-files netbase tzdata ca-certificates libc6 libssl3 libgcc-s1 libgomp1 libstdc++6)
debs=$IMAGE_CACHE/image-base/debs
mkdir -p "$debs"
download() { (cd "$debs" && apt-get download -q "${packages[@]}"); }
# The mirror moves on: when a cached list names a version it no longer has, refresh the lists.
download >/dev/null 2>&1 || { apt-get update -qq && download; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root"
versions=()
for p in "${packages[@]}"; do
  deb=$(ls -t "$debs/${p}_"*.deb | head -n1)
  dpkg-deb -x "$deb" "$root"
  versions+=("$p=$(dpkg-deb -f "$deb" Version)")
done
rm -rf "$root"/usr/share/{doc,man,info,lintian,locale,bug} \
  "$root"/usr/lib/x86_64-linux-gnu/gconv "$root"/usr/sbin "$root"/sbin "$root"/usr/bin \
  "$root"/etc/{init.d,default,update-motd.d,profile.d,skel}
mkdir -p "$root"/etc/ssl/certs "$root"/tmp "$root"/home/nonroot "$root"/root
find "$root"/usr/share/ca-certificates -name '*.crt' | LC_ALL=C sort | xargs cat \
  >"$root"/etc/ssl/certs/ca-certificates.crt
rm -rf "$root"/usr/share/ca-certificates "$root"/etc/ca-certificates.conf
cat >"$root"/etc/passwd <<'PASSWD'
root:x:0:0:root:/root:/sbin/nologin
nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
PASSWD
cat >"$root"/etc/group <<'GROUP'
root:x:0:
nobody:x:65534:
tty:x:5:
staff:x:50:
nonroot:x:65532:
GROUP
cat >"$root"/etc/nsswitch.conf <<'NSS'
passwd: files
group: files
shadow: files
hosts: files dns
networks: files
protocols: files
services: files
ethers: files
rpc: files
NSS
# The dynamic linker's cache, as a `ldconfig` in the image would write it.
ldconfig -r "$root" 2>/dev/null || true
chmod 1777 "$root"/tmp
chmod 0700 "$root"/root

ctr=$(bah from --quiet scratch)
trap 'bah rm "$ctr" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
bah copy --quiet "$ctr" "$root" / >/dev/null
bah copy --quiet --chown 65532:65532 "$ctr" "$work/rootfs/home/nonroot" /home/nonroot >/dev/null
bah config \
  --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
  --user 65532:65532 --workingdir /home/nonroot \
  --label "org.opencontainers.image.description=distroless/cc-debian12:nonroot rebuilt from Debian 12 packages" \
  --label "sessionflow.io/base-packages=${versions[*]}" \
  "$ctr"
old=$(bah inspect --type image --format '{{.FromImageID}}' "$BASE_IMAGE" 2>/dev/null || true)
bah commit --quiet --rm "$ctr" "$BASE_IMAGE" >/dev/null
[[ -z $old ]] || bah rmi "$old" >/dev/null 2>&1 || true
trap 'rm -rf "$work"' EXIT
echo "image-base: built $BASE_IMAGE ($(du -sh "$root" | cut -f1) from ${versions[*]})"
