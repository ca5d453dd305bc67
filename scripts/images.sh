#!/usr/bin/env bash
# Builds the kvgate images with no container engine and no registry (make images):
#   a root filesystem from the pinned Debian packages of images/packages.lock (libc, libgcc, CA
#   certificates, netbase, base-files; passwd/group entries for nonroot 65532), as distroless's
#   "cc" image is made, plus the binary; packed into an OCI image layout with umoci (two layers:
#   the base, then the binary; User 65532:65532, Entrypoint, OCI annotations) and exported with
#   skopeo as an OCI archive and a docker-archive tarball (`docker load`, `kind load image-archive`).
# Reproducible: every file's time is SOURCE_DATE_EPOCH (default: the commit's time), so the same
# binary and packages give the same digest.
#
# usage: scripts/images.sh [--profile release|debug] [--out DIR] [--no-archives] [--offline] [IMAGE...]
#        scripts/images.sh --fetch       (only download and check the pinned packages; make test-deps)
#        scripts/images.sh --relock      (pin the packages' current Debian versions)
# The packages are kept in target/images/debs/. --offline never downloads (the tests build their
# images inside the test world's network namespace, which reaches nothing outside 127.0.0.0/8).
# IMAGE is kvgate-operator or kvgate-worker (default both); binaries come from target/PROFILE/.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
out=target/images
archives=1
relock=0
fetch=0
offline=0
images=()
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-archives) archives=0; shift ;;
    --relock) relock=1; shift ;;
    --fetch) fetch=1; shift ;;
    --offline) offline=1; shift ;;
    kvgate-operator|kvgate-worker) images+=("$1"); shift ;;
    *) echo "scripts/images.sh: unknown argument $1 (see the usage at the top of the script)" >&2; exit 2 ;;
  esac
done
[ ${#images[@]} -gt 0 ] || images=(kvgate-operator kvgate-worker)

lock=images/packages.lock
if [ "$relock" = 1 ]; then
  tmp=$(mktemp -d)
  { grep '^#' "$lock"
    for name in libc6 libgcc-s1 ca-certificates netbase base-files; do
      (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "$name" >/dev/null)
      deb=$(ls "$tmp"/"${name}"_*.deb)
      echo "$name $(dpkg-deb -f "$deb" Version) $(sha256sum "$deb" | cut -d' ' -f1)"
    done; } >"$lock.new"
  mv "$lock.new" "$lock"
  rm -rf "$tmp"
  echo "pinned in $lock:"; grep -v '^#' "$lock"
  exit 0
fi

tools="umoci skopeo apt-get dpkg-deb"
[ "$fetch" = 1 ] && tools="apt-get"
for tool in $tools; do
  command -v "$tool" >/dev/null || { echo "scripts/images.sh: $tool not found; install it with: apt-get install umoci skopeo (make test-deps does)" >&2; exit 1; }
done

# The workspace's version: the first `version = ` line (read whole, then cut: no `| head`).
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml)
version=${version%%$'\n'*}
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
mkdir -p "$out"
work=$(mktemp -d "$out/.work.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The base root filesystem: the pinned packages, checked against their digests.
debs=target/images/debs
mkdir -p "$debs"
base=$work/base
mkdir -p "$base"
while read -r name ver sum; do
  case "$name" in ''|'#'*) continue ;; esac
  deb=$debs/${name}_${ver//:/%3a}.deb
  if [ ! -f "$deb" ] || [ "$(sha256sum "$deb" | cut -d' ' -f1)" != "$sum" ]; then
    [ "$offline" = 0 ] || { echo "scripts/images.sh: $deb is missing and --offline forbids downloading it; fetch the pinned packages with: make test-deps (or bash scripts/images.sh --fetch)" >&2; exit 1; }
    (cd "$work" && apt-get download -q -o APT::Sandbox::User=root "$name=$ver" >/dev/null) || {
      echo "scripts/images.sh: cannot download $name=$ver (pinned in $lock); if the mirror moved on, run: bash scripts/images.sh --relock" >&2; exit 1; }
    mv "$work"/"${name}"_*.deb "$deb"
  fi
  got=$(sha256sum "$deb" | cut -d' ' -f1)
  [ "$got" = "$sum" ] || { echo "scripts/images.sh: $deb has sha256 $got, $lock pins $sum" >&2; exit 1; }
  [ "$fetch" = 1 ] || dpkg-deb -x "$deb" "$base"
done <"$lock"
if [ "$fetch" = 1 ]; then
  echo "the pinned packages of $lock are in $debs"
  exit 0
fi
# What maintainer scripts would have made: the CA bundle, the users, a writable /tmp.
mkdir -p "$base/etc/ssl/certs" "$base/tmp" "$base/home/nonroot"
find "$base/usr/share/ca-certificates" -name '*.crt' | LC_ALL=C sort | xargs cat >"$base/etc/ssl/certs/ca-certificates.crt"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$base/etc/passwd"
printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$base/etc/group"
chmod 1777 "$base/tmp"
chown 65532:65532 "$base/home/nonroot"
rm -rf "$base/usr/share/doc" "$base/usr/share/man" "$base/usr/share/lintian"

for image in "${images[@]}"; do
  bin=target/$profile/$image
  [ -x "$bin" ] || { echo "scripts/images.sh: $bin not found; build it with: cargo build --profile $profile -p $image" >&2; exit 1; }
  layout=$out/oci/$image
  app=$work/$image
  mkdir -p "$app"
  install -m 0755 "$bin" "$app/$image"
  find "$base" "$app" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
  rm -rf "$layout"
  mkdir -p "$(dirname "$layout")"
  umoci init --layout "$layout"
  umoci new --image "$layout:$version"
  history=(--history.created "$created" --history.author kvgate)
  umoci insert --image "$layout:$version" "${history[@]}" --history.created_by "debian packages: $(grep -v '^#' "$lock" | cut -d' ' -f1,2 | tr '\n' ' ')" "$base" /
  umoci insert --image "$layout:$version" "${history[@]}" --history.created_by "target/$profile/$image" "$app" /
  umoci config --image "$layout:$version" --no-history \
    --created "$created" --author kvgate --architecture amd64 --os linux \
    --config.user 65532:65532 --config.entrypoint "/$image" --config.workingdir /home/nonroot \
    --config.env PATH=/usr/local/bin:/usr/bin:/bin --config.env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    --manifest.annotation "org.opencontainers.image.title=$image" \
    --manifest.annotation "org.opencontainers.image.version=$version" \
    --manifest.annotation "org.opencontainers.image.revision=$revision" \
    --manifest.annotation "org.opencontainers.image.source=https://github.com/kvgate/kvgate" \
    --manifest.annotation "org.opencontainers.image.created=$created" \
    --manifest.annotation "org.opencontainers.image.base.name=debian:bookworm (packages in images/packages.lock)"
  umoci gc --layout "$layout"
  digest=$(sed -n 's/.*"digest":"\(sha256:[0-9a-f]*\)".*/\1/p' "$layout/index.json")
  echo "$image:$version  $layout  $digest"
  if [ "$archives" = 1 ]; then
    ref=ghcr.io/kvgate/$image:$version
    rm -f "$out/$image-$version.oci.tar" "$out/$image-$version.docker.tar"
    skopeo copy -q "oci:$layout:$version" "oci-archive:$out/$image-$version.oci.tar:$ref"
    skopeo copy -q "oci:$layout:$version" "docker-archive:$out/$image-$version.docker.tar:$ref"
    echo "  $out/$image-$version.oci.tar, $out/$image-$version.docker.tar ($ref)"
  fi
done
