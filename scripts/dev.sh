#!/usr/bin/env bash
# One entry point for a fresh machine: builds the two environments on first use, then
#   bash scripts/dev.sh demo   - recompute BN stats on the built-in demo model and data
#   bash scripts/dev.sh test   - the whole test suite, in the main and the caffe2 environment
#   bash scripts/dev.sh setup  - only build the environments
# Torch is pinned in every install so pip never fetches another build.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

MAIN_VENV="$ROOT/.venv"
CAFFE2_VENV="$ROOT/.venv-caffe2"
MAIN_PINS=(torch==2.14.1 torchvision==0.29.1)
CAFFE2_PINS=(torch==1.10.2 "setuptools<70" numpy==1.22.4 "protobuf<4" six future typing_extensions networkx==2.8.8)
MAIN_EXTRAS="test,plot,lightning,classy,bench,timm,mmengine"
CAFFE2_EXTRAS="test"

log() { printf '[dev.sh] %s\n' "$*" >&2; }

# pip warns about every package its extra local indexes lack; keep its real output only. Torch's
# wheels take minutes to download and unpack, so a line every 15 s says how far the build got.
pip_install() {
  local venv=$1 status=0 ticker; shift
  (
    while sleep 15 && kill -0 $$ 2>/dev/null; do
      log "pip still working: $((SECONDS - BUILD_STARTED)) s into the build, $(du -sh "$venv" 2>/dev/null | cut -f1) in $venv"
    done
  ) &
  ticker=$!
  "$@" 2>&1 | { grep --line-buffered -v "is ignored: it is neither a file nor a directory" || true; } || status=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  return "$status"
}

# find_python VERSIONS: the first Python of VERSIONS (newest first: "3.13 3.12 3.11", or 3.9)
# found, through pyenv when it has that version, else as pythonX.Y on the PATH; sets PYTHON.
find_python() {
  local v
  for v in $1; do
    if command -v pyenv >/dev/null 2>&1 && pyenv versions --bare 2>/dev/null | grep -q "^$v"; then
      PYTHON=$(PYENV_VERSION=$v pyenv which "python$v"); return
    elif command -v "python$v" >/dev/null 2>&1 && PYENV_VERSION=$v "python$v" -c '' 2>/dev/null; then
      PYTHON=$(PYENV_VERSION=$v "python$v" -c 'import sys; print(sys.executable)'); return
    fi
  done
  log "none of Python $1 found: install one (pyenv install ${1%% *}) and rerun"; exit 1
}

# build_env VENV PYVERS EXTRAS PINS...: (re)install when pyproject.toml or this script changed.
build_env() {
  local venv=$1 pyvers=$2 extras=$3; shift 3
  local stamp
  BUILD_STARTED=$SECONDS
  stamp=$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -c1-16)
  if [ -f "$venv/.stamp" ] && [ "$(cat "$venv/.stamp")" = "$stamp" ]; then return; fi
  if [ -x "$venv/bin/python" ]; then
    PYTHON="$venv/bin/python"
  else
    find_python "$pyvers"
  fi
  log "building $venv with Python $("$PYTHON" -c 'import sys; print(sys.version.split()[0])') ($PYTHON)"
  log "first build: a few minutes, several GB of wheels (README.md, 'Install and environments')"
  [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
  pip_install "$venv" "$venv/bin/python" -m pip install -q --upgrade "pip<25" wheel
  pip_install "$venv" "$venv/bin/python" -m pip install --progress-bar off "$@"
  pip_install "$venv" "$venv/bin/python" -m pip install -q -e ".[$extras]" "$@"
  echo "$stamp" >"$venv/.stamp"
  log "built $venv in $((SECONDS - BUILD_STARTED)) s ($(du -sh "$venv" | cut -f1))"
}

setup_main() { build_env "$MAIN_VENV" "3.13 3.12 3.11" "$MAIN_EXTRAS" "${MAIN_PINS[@]}"; }
setup_caffe2() { build_env "$CAFFE2_VENV" 3.9 "$CAFFE2_EXTRAS" "${CAFFE2_PINS[@]}"; }

run_tests() {
  local status=0
  setup_main
  setup_caffe2
  log "main environment: $("$MAIN_VENV/bin/python" -c 'import sys,torch;print(sys.version.split()[0],"torch",torch.__version__)')"
  "$MAIN_VENV/bin/python" -m pytest -q -m "not caffe2_env" "$@" || status=$?
  log "caffe2 environment: $("$CAFFE2_VENV/bin/python" -c 'import sys,torch;print(sys.version.split()[0],"torch",torch.__version__)')"
  "$CAFFE2_VENV/bin/python" -m pytest -q -m "not main_env" "$@" || status=$((status ? status : $?))
  return $status
}

cmd=${1:-help}; shift || true
case "$cmd" in
  setup) setup_main; setup_caffe2 ;;
  demo) setup_main; exec "$MAIN_VENV/bin/precise-bn" demo "$@" ;;
  test) run_tests "$@" ;;
  *) sed -n '2,6p' "$0"; exit 2 ;;
esac
