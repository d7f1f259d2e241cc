#!/usr/bin/env bash
# Installs, from Debian's packages, whatever this project needs to build and test and is missing.
# Idempotent: checks each package with dpkg first and runs apt-get only when something is absent.
# Usage: scripts/bootstrap.sh            (needs root or sudo when something must be installed)
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config git
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev libboost-dev nlohmann-json3-dev
  libicu-dev libsystemd-dev libxxhash-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-numpy python3-yaml python3-pytest util-linux clang-format
  python3-venv python3-pip patchelf binutils   # the wheel: scripts/build-wheel.sh and its test
)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "bootstrap: all ${#PKGS[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "bootstrap: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
