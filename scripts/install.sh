#!/usr/bin/env bash
# Install pdserve and what it needs. Usage: bash scripts/install.sh [--test|--backends]
#   --test      also the test tools, the demo-model builder, the real sglang-router binary, the
#               Mooncake and NIXL KV transfer backends and (as root) Debian's iproute2 for the
#               network-namespace tests and dnsmasq for the DNS discovery tests (their tests
#               skip, saying why, if these fail).
#   --backends  pdserve plus the Mooncake and NIXL transfer backends.
# A CUDA torch that is already installed is kept; otherwise a CPU-only machine gets the CPU
# wheel (torch==2.13.0+cpu), which avoids pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP="$PY -m pip install --disable-pip-version-check -q"

# pdserve's CPU kernels are C++ built against torch: a C++ compiler is needed (ninja comes from PyPI)
if ! command -v g++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -q --no-install-recommends g++ >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends g++ >/dev/null; } \
    || echo "install.sh: g++ could not be installed; pdserve will run without its CPU kernels (slower)" >&2
fi

# the network-namespace tests (tests/e2e/test_netns*.py) need `ip` and `tc` from iproute2
if [ "${1:-}" = "--test" ] && ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -q --no-install-recommends iproute2 >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends iproute2 >/dev/null; } \
    || echo "install.sh: iproute2 could not be installed; the network-namespace tests will skip" >&2
fi

# tests/e2e/test_isa_tiers.py runs pdserve on an emulated CPU without AVX-512 (qemu-user)
if [ "${1:-}" = "--test" ] && ! command -v qemu-x86_64-static >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -q --no-install-recommends qemu-user-static >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends qemu-user-static >/dev/null; } \
    || echo "install.sh: qemu-user-static could not be installed; the emulated-CPU test will fail saying so" >&2
fi

# the DNS discovery tests (tests/e2e/test_router_dns.py) run Debian's dnsmasq unprivileged on a high port
if [ "${1:-}" = "--test" ] && ! [ -x /usr/sbin/dnsmasq ] && ! command -v dnsmasq >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -q --no-install-recommends dnsmasq >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends dnsmasq >/dev/null; } \
    || echo "install.sh: dnsmasq could not be installed; the DNS discovery tests will skip" >&2
fi

if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PIP torch
  else
    $PIP "torch==2.13.0" || $PIP "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
fi

# KV transfer backends (--disaggregation-transfer-backend mooncake|nixl). Each step may fail on
# an unusual platform: pdserve then runs without that backend and its tests say why they skip.
install_transfer_backends() {
  # Mooncake links libibverbs.so.1 even for TCP. Debian's libibverbs1 recommends ibverbs-providers,
  # with which NIXL processes crash at exit: install the library alone.
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! ldconfig -p | grep "libibverbs.so.1 " >/dev/null; then
    apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null; } \
      || echo "install.sh: libibverbs1 could not be installed; the mooncake backend will not load" >&2
  fi
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PIP "mooncake-transfer-engine" || echo "install.sh: mooncake-transfer-engine could not be installed" >&2
  else
    $PIP "mooncake-transfer-engine-non-cuda" \
      || echo "install.sh: mooncake-transfer-engine-non-cuda could not be installed" >&2
  fi
  # NIXL: --no-deps, or pip pulls a CUDA torch and the wheels for every CUDA major; it needs only
  # numpy and torch at run time. The nixl-cuXX wheel follows torch's CUDA major (12 on CPU hosts).
  local cuda_major
  cuda_major=$($PY -c "import torch; print((torch.version.cuda or '12').split('.')[0])" 2>/dev/null || echo 12)
  $PIP --no-deps "nixl==1.5.1" "nixl-cu${cuda_major}==1.5.1" \
    || echo "install.sh: nixl could not be installed" >&2
}

if [ "${1:-}" = "--test" ]; then
  $PIP -e ".[demo,bench,test]"
  # compressed-tensors' own compressor and decompressor write and check the tests' checkpoints of
  # its formats (pure Python; --no-deps: its torch pin must not replace the CPU wheel)
  $PIP --no-deps "compressed-tensors==0.20.1" "loguru>=0.7"
  # the real Rust router, for the wire-compatibility tests (a plain wheel, no torch)
  $PIP "sglang-router==0.3.2" || echo "install.sh: sglang-router could not be installed on this platform" >&2
  install_transfer_backends
else
  $PIP -e ".[demo,bench]"
  if [ "${1:-}" = "--backends" ]; then
    install_transfer_backends
  fi
fi

# The default grammar engine (structured outputs). --no-deps: its declared dependencies pull a CUDA
# torch and triton, which it does not need on CPU (torch and transformers are already here).
$PIP --no-deps "xgrammar==0.2.9" || echo "install.sh: xgrammar could not be installed; use --grammar-backend llguidance" >&2

# Build the CPU kernels now rather than at the first server start (about 300 CPU-seconds, the
# files side by side; cached by source and compiler key, docs/architecture.md "Building the
# kernels"). A failure is not fatal: pdserve then uses its PyTorch paths.
$PY -m pdserve.kernels || echo "install.sh: the CPU kernels did not build; pdserve will use its slower PyTorch paths" >&2

# --test: pdserve's kernels on emulated Arm CPUs (tests/unit/test_kernels_arm64.py, docs/arm64.md):
# Debian's aarch64 cross g++ and qemu-user, an arm64 userland with torch, and the aarch64 build of
# the kernels, cached in ~/.cache/pdserve/arm64 (cold: about 1 minute of downloads and 4 minutes of
# compiling on 2 cores). If this fails, that test fails saying why.
if [ "${1:-}" = "--test" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  $PY scripts/arm64_kernels.py --setup-only >/dev/null 2>&1 \
    || echo "install.sh: the arm64 kernel tests could not be prepared (run scripts/arm64_kernels.py --setup-only to see why)" >&2
fi
