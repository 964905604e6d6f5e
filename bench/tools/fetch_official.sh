#!/usr/bin/env bash
# Extract the official DINOv2 (or DINOv3) source (never vendored) into DEST (default .official/dinov2, git-ignored) for
# bench/gpu_bench.py, from SRC: a git directory (a bare mirror or a clone's .git) or a URL to clone (online).
#   bench/tools/fetch_official.sh /work/.mirror/facebookresearch+dinov2/repo
#   bench/tools/fetch_official.sh https://github.com/facebookresearch/dinov2
# DEST/COMMIT records the commit; the GPU machine has no network: carry DEST there (and .whl, see the Makefile).
set -euo pipefail
src=${1:-https://github.com/facebookresearch/dinov2}
dest=${2:-.official/dinov2}
ref=${REF:-HEAD}
tmp=""
if [ ! -d "$src" ]; then
  tmp=$(mktemp -d)
  git clone -q --bare "$src" "$tmp/repo"
  src="$tmp/repo"
fi
rm -rf "$dest"
mkdir -p "$dest"
# PATHS (optional): only these paths of the tree (a mirror may lack the blobs of large notebooks)
# shellcheck disable=SC2086
git --git-dir="$src" archive "$ref" ${PATHS:-} | tar -x -C "$dest"
git --git-dir="$src" rev-parse "$ref" > "$dest/COMMIT"
[ -n "$tmp" ] && rm -rf "$tmp"
echo "official $(basename "$dest") $(cat "$dest/COMMIT") in $dest ($(du -sh "$dest" | cut -f1))"
