#!/usr/bin/env bash
# Build the sandbox image without a registry (what `make sandbox-image` runs):
#   1. build-rootfs.sh debootstraps a minimal Debian root filesystem with Python 3;
#   2. `docker import` makes it the base image corral-sandbox-base:<base hash>;
#   3. `docker build` adds the runner FROM that base and tags corral-sandbox:dev.
# Usage: deploy/images/sandbox/build.sh [TAG]
# Talks to the engine the docker CLI would (DOCKER_HOST honoured). Needs root for
# debootstrap, unless the base image is already in the engine. Does nothing when TAG already
# carries the current recipe hash; set REBUILD=1 to build anyway.
#
# The hashes are computed exactly as tests/docker_engine.py computes them, so the image one
# makes is the image the other reuses.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
tag=${1:-corral-sandbox:dev}

# sha256 over "<sha256>  <path>" lines of the files under the given repository paths.
recipe_hash() {
  (
    cd "$repo"
    find "$@" -name __pycache__ -prune -o -type f ! -name '*.pyc' -print \
      | LC_ALL=C sort | xargs -d '\n' sha256sum
  ) | sha256sum | cut -c1-16
}

recipe=$(recipe_hash deploy/images/sandbox runner)
base_hash=$(recipe_hash deploy/images/sandbox/build-rootfs.sh)
base=corral-sandbox-base:$base_hash

current=$(docker image inspect --format '{{ index .Config.Labels "corral.recipe-hash" }}' \
  "$tag" 2>/dev/null || true)
if [ "$current" = "$recipe" ] && [ "${REBUILD:-0}" != 1 ]; then
  echo "$tag is up to date (recipe $recipe)"
  exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/corral-sandbox-image.XXXXXX")
trap 'rm -rf "$work"' EXIT

if docker image inspect "$base" >/dev/null 2>&1; then
  echo "base image $base is present"
else
  "$here/build-rootfs.sh" "$work/rootfs.tar"
  docker import "$work/rootfs.tar" "$base"
  rm -f "$work/rootfs.tar"
fi

mkdir "$work/context"
cp "$here/Dockerfile" "$work/context/"
tar -C "$repo" --exclude=__pycache__ --exclude='*.pyc' -cf - runner | tar -C "$work/context" -xf -

# No network in the build: every step works offline, and the engine may have no bridge.
docker build --network none \
  --build-arg "BASE_IMAGE=$base" --build-arg "RECIPE_HASH=$recipe" \
  --tag "$tag" "$work/context"
echo "built $tag (recipe $recipe, base $base)"
