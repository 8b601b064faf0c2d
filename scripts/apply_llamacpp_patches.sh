#!/usr/bin/env bash
# specft's fixes to llama.cpp, applied to the pinned source before it is built
# (scripts/install_llamacpp.sh runs this; docs/serving.md says what each fixes and why).
#
#   bash scripts/apply_llamacpp_patches.sh SRC [PATCH_DIR]    # PATCH_DIR: scripts/llamacpp_patches
#
# Each PATCH_DIR/*.patch (`diff -u` against the source root, -p1), in name order: skipped
# when already applied, applied when it applies cleanly, and otherwise the run stops with
# one line and the source unchanged (every patch is checked before any is applied): the
# pinned version changed under the patch, which must then be ported. Prints the applied
# patches' names and sha256 as `name:sha256` lines on stdout for install.json.
set -euo pipefail

SRC="${1:?usage: apply_llamacpp_patches.sh SRC [PATCH_DIR]}"
PATCH_DIR="${2:-$(cd "$(dirname "$0")" && pwd)/llamacpp_patches}"
command -v patch >/dev/null || { echo "install_llamacpp: patch is missing (apt-get install patch)" >&2; exit 2; }

shopt -s nullglob
patches=("$PATCH_DIR"/*.patch)
todo=()
for p in "${patches[@]}"; do
    if patch -p1 -R --dry-run -s -f -d "$SRC" <"$p" >/dev/null 2>&1; then
        continue  # applied by an earlier install
    fi
    if ! patch -p1 --dry-run -s -f -d "$SRC" <"$p" >/dev/null 2>&1; then
        echo "install_llamacpp: $(basename "$p") no longer applies to the llama.cpp source in $SRC (the pinned" \
             "version changed?); port the patch to this version, or remove $SRC to fetch the pinned one again" >&2
        exit 2
    fi
    todo+=("$p")
done
for p in "${todo[@]}"; do
    patch -p1 -s -f -d "$SRC" <"$p" >/dev/null
done
for p in "${patches[@]}"; do
    echo "$(basename "$p"):$(sha256sum "$p" | cut -d' ' -f1)"
done
