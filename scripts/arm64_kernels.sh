#!/usr/bin/env bash
# pdserve's CPU kernels on aarch64 without Arm hardware: cross-built with Debian's g++, their unit
# tests run under qemu-user on emulated Arm CPUs (docs/arm64.md). Usage: scripts/arm64_kernels.py --help
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/arm64_kernels.py" "$@"
