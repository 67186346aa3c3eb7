#!/usr/bin/env bash
# Installs plat (the plat-transformers distribution) with everything its jobs, experiments and tests need, on a
# fresh Debian/Ubuntu machine with Python >= 3.10. CPU machines get the CPU build of torch; on a GPU machine
# install your CUDA torch first and it is kept.
set -euo pipefail
cd "$(dirname "$0")"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ ! -d /usr/share/datasets/fashion-mnist ]; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq dataset-fashion-mnist
fi
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip uninstall -q -y plat 2>/dev/null || true  # the distribution's former name
python -m pip install -q -e ".[test]"
