#!/usr/bin/env bash
# Builds .nbcarry/ in this checkout: what executing the notebooks (tests/gpu/run_notebooks.py) needs
# on the lent GPU machines beyond their image, which has Python 3.12, CUDA 13, numba-cuda, CuPy,
# torch, mpi4py and Open MPI, perhaps not Jupyter's packages or matplotlib, and no package index:
#   - wheels/: nbclient, nbformat, ipykernel and jupyter_client (the versions the CPU tests run
#     with) and all their dependencies as Python 3.12 x86-64 binary wheels, less NumPy (the image
#     has it: numba-cuda, CuPy and torch need it; its wheel alone is 16 MB). matplotlib is not
#     carried: the lent image has 3.11.2 (the version the CPU tests use), checked there, and
#     carrying it would double the folder;
#   - setup.sh, to source on the machine (see its header): installs what the image lacks into
#     /tmp/nbsite and puts that on PYTHONPATH.
# Usage, from the project root:   bash tools/build_nbcarry.sh
#
# .nbcarry is about 15 MB and .devcarry 46 MB: with the working tree (under ~3 MB) they fit the
# 64 MiB a device call carries, so one call carries both:
#   carry [".devcarry", ".nbcarry"]:  source .devcarry/setup.sh && source .nbcarry/setup.sh &&
#                                     python3 tests/gpu/run_notebooks.py --out "$OUT/notebooks"
set -euo pipefail
root="$(git rev-parse --show-toplevel)"
cd "$root"
dest="$root/.nbcarry"
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.nbcarry/' "$exclude" 2>/dev/null || echo '/.nbcarry/' >> "$exclude"

requirements=(nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0 jupyter_client==8.10.0)
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
rm -rf "$dest"
mkdir -p "$dest/wheels"
python3 -m pip download -q "${plat[@]}" -d "$dest/wheels" "${requirements[@]}"
rm -f "$dest"/wheels/numpy-*.whl

cat > "$dest/setup.sh" <<'SETUP'
# Source on a lent GPU machine (after .devcarry/setup.sh if that is used too):  source .nbcarry/setup.sh
# Written by tools/build_nbcarry.sh. Makes nbclient, nbformat, ipykernel and jupyter_client
# importable (matplotlib comes with the image): pip resolves them, offline, against what is installed (the image, and
# /tmp/site when .devcarry/setup.sh was sourced first), and installs only what is missing or too
# old, from wheels/, into /tmp/nbsite (once: marker /tmp/nbsite/.ready), and appends /tmp/nbsite
# to PYTHONPATH (PYTHONPATH precedes site-packages, so a too-old package of the image is shadowed
# by the newer one installed there; nothing the image has in a usable version is); registers a
# python3 kernelspec if jupyter_client finds none.
# NBCARRY_SITE overrides /tmp/nbsite.
_nc="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_ns="${NBCARRY_SITE:-/tmp/nbsite}"
if [ ! -f "$_ns/.ready" ]; then
  _report="$(mktemp)"
  if python3 -m pip install -q --dry-run --no-index --find-links "$_nc/wheels" --report "$_report" \
      nbclient nbformat ipykernel jupyter_client; then
    _whl="$(python3 - "$_report" <<'PY'
import json, sys, urllib.parse, urllib.request
for item in json.load(open(sys.argv[1]))["install"]:
    print(urllib.request.url2pathname(urllib.parse.urlparse(item["download_info"]["url"]).path))
PY
)"
    mkdir -p "$_ns"
    if [ -z "$_whl" ] || python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$_ns" $_whl; then
      touch "$_ns/.ready"
      echo "nbcarry: $(printf '%s\n' $_whl | grep -c . || true) packages installed into $_ns:" \
        $(for w in $_whl; do basename "$w" | cut -d- -f1-2; done)
    else
      echo "nbcarry: installing into $_ns failed" >&2
    fi
  else
    echo "nbcarry: pip could not resolve the notebook packages from $_nc/wheels (see above)" >&2
  fi
  rm -f "$_report"
  unset _report _whl
fi
case ":${PYTHONPATH:-}:" in
  *":$_ns:"*) ;;
  *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_ns" ;;
esac
if ! python3 -c 'import sys; from jupyter_client.kernelspec import KernelSpecManager as K; sys.exit("python3" not in K().find_kernel_specs())' 2>/dev/null; then
  python3 -m ipykernel install --user --name python3 >/dev/null || echo "nbcarry: no python3 kernelspec" >&2
fi
unset _nc _ns
SETUP

echo ".nbcarry is ready: $(du -sh "$dest" | cut -f1) in $(ls "$dest/wheels" | wc -l) wheels; carry it as \".nbcarry\", alone"
