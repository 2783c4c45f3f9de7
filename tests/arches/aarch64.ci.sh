# AArch64's packages for .ci/run (sourced there, before the setup; bash, set -euo pipefail).
# AArch64: the cross toolchain and C library (tests/test_aarch64_runtime.py in the default run, and
# KPREWRITE_TEST_ARCH=aarch64); programs run under qemu-aarch64 (qemu-user, above).
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v aarch64-linux-gnu-g++ >/dev/null \
   || [ ! -d /usr/aarch64-linux-gnu/include ] || ! command -v qemu-aarch64 >/dev/null; then
  apt-get update -qq
  apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu g++-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null
fi
# tests/test_aarch64_real_software.py fetches Debian's arm64 busybox-static, sqlite3 and libsqlite3
# itself (apt-get download, into ~/.cache/kprewrite/debian-arm64): apt needs the arm64 lists.
if ! dpkg --print-foreign-architectures | grep -qx arm64 \
   || ! apt-cache show libsqlite3-0:arm64 >/dev/null 2>&1; then
  dpkg --add-architecture arm64
  apt-get update -qq
fi
# arm64 kernel tests (tests/kernel/*arm64*): qemu-system-aarch64 (qemu-system-arm) boots Debian's arm64
# cloud kernel and busybox-static:arm64, which the tests fetch themselves (apt-get download, into
# ~/.cache/kprewrite/kernel/arm64; the arm64 apt lists are added above).
# qemu-efi-aarch64: the UEFI boot (AAVMF).
if ! command -v qemu-system-aarch64 >/dev/null || [ ! -e /usr/share/AAVMF/AAVMF_CODE.fd ]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends qemu-system-arm qemu-efi-aarch64 >/dev/null
fi
