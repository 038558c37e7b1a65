#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then builds the README example against it
# twice: through find_package(bie) and through pkg-config. Args: build-dir source-dir.
set -euo pipefail
build=$1 src=$2
prefix=$(mktemp -d)
trap 'rm -rf "$prefix"' EXIT
cmake --install "$build" --prefix "$prefix" >/dev/null
cmake -S "$src/tests/install" -B "$prefix/consumer" -DCMAKE_PREFIX_PATH="$prefix" \
  -DEXAMPLE="$src/examples/train_step.c" >/dev/null
cmake --build "$prefix/consumer" >/dev/null
LD_LIBRARY_PATH="$prefix/lib:${LD_LIBRARY_PATH:-}" "$prefix/consumer/consumer" | grep -q "packed inference"
libdir=$(dirname "$(find "$prefix" -name bie.pc)")
cc "$src/examples/train_step.c" $(PKG_CONFIG_PATH="$libdir" pkg-config --cflags --libs bie) \
  -Wl,-rpath,"$libdir/.." -o "$prefix/via_pkgconfig"
"$prefix/via_pkgconfig" | grep -q "packed inference"
echo "install: CMake package and pkg-config both work"
