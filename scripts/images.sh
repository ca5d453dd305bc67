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
# The test images of engines users run, built the same way (the tests ask for them; `make images`
# does not), on Python 3.11 from the pinned Debian packages of images/python.lock:
#   `llamacpp`: llama.cpp's server from the pinned `xllamacpp` wheel (images/llamacpp/
#   requirements.txt), started by images/llamacpp/llama-server (llama-server's flags);
#   `vllm`: vLLM's CPU build and its pinned wheels (images/vllm/requirements.txt, several GB,
#   fetched by --fetch-vllm only), started as `python3.11 -m vllm.entrypoints.openai.api_server`.
#
# usage: scripts/images.sh [--profile release|debug] [--out DIR] [--no-archives] [--offline] [IMAGE...]
#        scripts/images.sh --fetch       (only download and check the pinned packages and wheels; make test-deps)
#        scripts/images.sh --fetch-vllm  (the same for the vLLM image's wheels; make test-vllm-deps)
#        scripts/images.sh --relock      (pin the packages' current Debian versions)
# The packages are kept in target/images/debs/, the wheels in target/images/wheels/. --offline
# never downloads (the tests build their images inside the test world's network namespace, which
# reaches nothing outside 127.0.0.0/8).
# IMAGE is kvgate-operator, kvgate-worker (default both; binaries from target/PROFILE/), llamacpp or vllm.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
out=target/images
archives=1
relock=0
fetch=0
fetch_vllm=0
offline=0
images=()
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --no-archives) archives=0; shift ;;
    --relock) relock=1; shift ;;
    --fetch) fetch=1; shift ;;
    --fetch-vllm) fetch=1; fetch_vllm=1; shift ;;
    --offline) offline=1; shift ;;
    kvgate-operator|kvgate-worker|llamacpp|vllm) images+=("$1"); shift ;;
    *) echo "scripts/images.sh: unknown argument $1 (see the usage at the top of the script)" >&2; exit 2 ;;
  esac
done
[ ${#images[@]} -gt 0 ] || images=(kvgate-operator kvgate-worker)

lock=images/packages.lock
python_lock=images/python.lock
vllm_lock=images/vllm/packages.lock
# What each lock pins: the base of every image; Python 3.11 and the C++ runtime of the engine image.
base_packages="libc6 libgcc-s1 ca-certificates netbase base-files"
python_packages="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib media-types libexpat1 zlib1g libssl3 libbz2-1.0
  libcrypt1 libdb5.3 libffi8 liblzma5 libncursesw6 libtinfo6 libnsl2 libtirpc3 libtirpc-common libgssapi-krb5-2 libkrb5-3
  libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libreadline8 readline-common libsqlite3-0 libuuid1 libstdc++6 libgomp1 gcc-12-base"
vllm_packages="dash util-linux libsmartcols1 libnuma1"
if [ "$relock" = 1 ]; then
  tmp=$(mktemp -d)
  for pair in "$lock:$base_packages" "$python_lock:$python_packages" "$vllm_lock:$vllm_packages"; do
    file=${pair%%:*}
    { grep '^#' "$file"
      for name in ${pair#*:}; do
        (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "$name" >/dev/null)
        deb=$(ls "$tmp"/"${name}"_*.deb)
        echo "$name $(dpkg-deb -f "$deb" Version) $(sha256sum "$deb" | cut -d' ' -f1)"
      done; } >"$file.new"
    mv "$file.new" "$file"
    echo "pinned in $file:"; grep -v '^#' "$file"
  done
  rm -rf "$tmp"
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

# The pinned packages of a lock, checked against their digests (downloaded unless --offline), and
# unpacked into DIR (not with --fetch).
debs=target/images/debs
mkdir -p "$debs"
packages() {
  local file=$1 dir=$2 name ver sum deb got
  while read -r name ver sum; do
    case "$name" in ''|'#'*) continue ;; esac
    deb=$debs/${name}_${ver//:/%3a}.deb
    if [ ! -f "$deb" ] || [ "$(sha256sum "$deb" | cut -d' ' -f1)" != "$sum" ]; then
      [ "$offline" = 0 ] || { echo "scripts/images.sh: $deb is missing and --offline forbids downloading it; fetch the pinned packages with: make test-deps (or bash scripts/images.sh --fetch)" >&2; exit 1; }
      (cd "$work" && apt-get download -q -o APT::Sandbox::User=root "$name=$ver" >/dev/null) || {
        echo "scripts/images.sh: cannot download $name=$ver (pinned in $file); if the mirror moved on, run: bash scripts/images.sh --relock" >&2; exit 1; }
      mv "$work"/"${name}"_*.deb "$deb"
    fi
    got=$(sha256sum "$deb" | cut -d' ' -f1)
    [ "$got" = "$sum" ] || { echo "scripts/images.sh: $deb has sha256 $got, $file pins $sum" >&2; exit 1; }
    [ "$fetch" = 1 ] || dpkg-deb -x "$deb" "$dir"
  done <"$file"
}
# The engine image's wheels, pinned by digest (pip --require-hashes), kept in target/images/wheels.
wheels=target/images/wheels
pip=target/images/pip
fetch_wheels() {
  local requirements=$1
  mkdir -p "$wheels"
  [ -x "$pip/bin/pip" ] || python3 -m venv "$pip" || {
    echo "scripts/images.sh: cannot make a Python venv for pip (python3 -m venv; make test-deps installs python3-venv)" >&2; exit 1; }
  "$pip/bin/pip" download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.11 --require-hashes \
    -r "$requirements" -d "$wheels" || {
    echo "scripts/images.sh: cannot download the wheels of $requirements" >&2; exit 1; }
}

base=$work/base
mkdir -p "$base"
packages "$lock" "$base"
if [ "$fetch" = 1 ]; then
  packages "$python_lock" "$base"
  fetch_wheels images/llamacpp/requirements.txt
  [ "$fetch_vllm" = 0 ] || { packages "$vllm_lock" "$base"; fetch_wheels images/vllm/requirements.txt; }
  echo "the pinned packages of $lock and $python_lock are in $debs, the pinned wheels in $wheels"
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

# An image: the base, then what makes it (LAYER DESCRIPTION pairs), as user 65532 with an
# entrypoint (its words separated by spaces).
pack() {
  local image=$1 layout=$out/oci/$1 word entrypoint=()
  for word in $2; do entrypoint+=(--config.entrypoint "$word"); done
  shift 2
  rm -rf "$layout"
  mkdir -p "$(dirname "$layout")"
  umoci init --layout "$layout"
  umoci new --image "$layout:$version"
  history=(--history.created "$created" --history.author kvgate)
  umoci insert --image "$layout:$version" "${history[@]}" --history.created_by "debian packages: $(grep -v '^#' "$lock" | cut -d' ' -f1,2 | tr '\n' ' ')" "$base" /
  while [ $# -gt 0 ]; do
    find "$1" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
    umoci insert --image "$layout:$version" "${history[@]}" --history.created_by "$2" "$1" /
    shift 2
  done
  umoci config --image "$layout:$version" --no-history \
    --created "$created" --author kvgate --architecture amd64 --os linux \
    --config.user 65532:65532 "${entrypoint[@]}" --config.workingdir /home/nonroot \
    --config.env PATH=/usr/local/bin:/usr/bin:/bin --config.env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    --manifest.annotation "org.opencontainers.image.title=$image" \
    --manifest.annotation "org.opencontainers.image.version=$version" \
    --manifest.annotation "org.opencontainers.image.revision=$revision" \
    --manifest.annotation "org.opencontainers.image.source=https://github.com/kvgate/kvgate" \
    --manifest.annotation "org.opencontainers.image.created=$created" \
    --manifest.annotation "org.opencontainers.image.base.name=debian:bookworm (packages in images/packages.lock)"
  umoci gc --layout "$layout"
}

find "$base" -exec touch -h -d "@$SOURCE_DATE_EPOCH" {} +
for image in "${images[@]}"; do
  layout=$out/oci/$image
  app=$work/$image
  mkdir -p "$app"
  python=$work/python
  if [ "$image" = llamacpp ] || [ "$image" = vllm ]; then
    # Python 3.11 and the C++ runtime, then the wheels where Debian's Python looks.
    mkdir -p "$python"
    [ -x "$python/usr/bin/python3.11" ] || packages "$python_lock" "$python"
    rm -rf "$python/usr/share/doc" "$python/usr/share/man"
  fi
  if [ "$image" = vllm ]; then
    # A shell and lscpu (vLLM's CPU worker runs it), then every pinned wheel, installed (not
    # downloaded: --no-index) for Debian's Python 3.11.
    packages "$vllm_lock" "$app"
    ln -sf dash "$app/bin/sh"
    rm -rf "$app/usr/share/doc" "$app/usr/share/man" "$app/usr/share/locale"
    "$pip/bin/pip" install -q --disable-pip-version-check --no-index --no-deps --only-binary=:all: --python-version 3.11 --find-links "$wheels" --require-hashes \
      -r images/vllm/requirements.txt --target "$app/usr/local/lib/python3.11/dist-packages" || {
      echo "scripts/images.sh: installing images/vllm/requirements.txt from $wheels failed; fetch the wheels with: make test-vllm-deps" >&2; exit 1; }
    pack "$image" "/usr/bin/python3.11 -m vllm.entrypoints.openai.api_server" "$python" "debian packages: $(grep -v '^#' "$python_lock" | cut -d' ' -f1,2 | tr '\n' ' ')" \
      "$app" "debian packages: $(grep -v '^#' "$vllm_lock" | cut -d' ' -f1,2 | tr '\n' ' '); the wheels of images/vllm/requirements.txt"
  elif [ "$image" = llamacpp ]; then
    site=$app/usr/local/lib/python3.11/dist-packages
    mkdir -p "$site"
    whl=$(ls "$wheels"/xllamacpp-*.whl 2>/dev/null) || { echo "scripts/images.sh: no xllamacpp wheel in $wheels; fetch it with: make test-deps (or bash scripts/images.sh --fetch)" >&2; exit 1; }
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$whl" "$site"
    install -D -m 0755 images/llamacpp/llama-server "$app/usr/local/bin/llama-server"
    pack "$image" /usr/local/bin/llama-server "$python" "debian packages: $(grep -v '^#' "$python_lock" | cut -d' ' -f1,2 | tr '\n' ' ')" \
      "$app" "$(basename "$whl") and images/llamacpp/llama-server"
  else
    bin=target/$profile/$image
    [ -x "$bin" ] || { echo "scripts/images.sh: $bin not found; build it with: cargo build --profile $profile -p $image" >&2; exit 1; }
    install -m 0755 "$bin" "$app/$image"
    pack "$image" "/$image" "$app" "target/$profile/$image"
  fi
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
