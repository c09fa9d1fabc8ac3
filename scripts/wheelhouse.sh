#!/usr/bin/env bash
# Build a folder of wheels that installs attnlab and everything it needs with no package registry.
#
#   scripts/wheelhouse.sh OUT_DIR [PYTHON_VERSION] [PLATFORM] [--cuda cu130|cu128|cpu] [--cpu] [--no-torch]
#   scripts/wheelhouse.sh wheels 3.12 manylinux_2_28_x86_64 --cuda cu130      # a CUDA 13.0 GPU cluster
#   scripts/wheelhouse.sh /tmp/wh 3.11 manylinux_2_28_x86_64 --cpu --no-torch # small: everything but torch/triton
#
# Then, on the offline machine (same Python version and platform):
#   bash OUT_DIR/install.sh [PIP_ARGS...]       # = pip install --no-index --find-links OUT_DIR attnlab
#
# Defaults: PYTHON_VERSION = this machine's python3, PLATFORM = manylinux_2_28_x86_64, --cuda cu130.
# torch comes from the PyTorch index of the chosen CUDA build (https://download.pytorch.org/whl/<cuda>),
# everything else from PyPI (plus whatever the environment's pip configuration adds). Only binary wheels
# for the target are taken (--only-binary=:all:), and the full dependency closure is resolved by pip
# (pip download without --no-deps), starting from this project's own wheel, so every runtime dependency in
# pyproject.toml is included. --no-torch leaves torch and triton out (install them separately); their
# own pure-Python dependencies are still included. Environment: TORCH_VERSION (default 2.13.0),
# EXTRAS (default "test"; "" for none; e.g. "test,hf"), PYTHON (the interpreter running pip, default python3).
set -euo pipefail

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
EXTRAS="${EXTRAS-test}"
CUDA="cu130"
NO_TORCH=0
POS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) CUDA="${2:?--cuda needs a value: cu130, cu128, cu126 or cpu}"; shift 2 ;;
    --cuda=*) CUDA="${1#--cuda=}"; shift ;;
    --cpu) CUDA="cpu"; shift ;;
    --no-torch) NO_TORCH=1; shift ;;
    -h|--help) usage 0 ;;
    -*) echo "wheelhouse.sh: unknown option $1" >&2; usage 2 ;;
    *) POS+=("$1"); shift ;;
  esac
done
[ ${#POS[@]} -ge 1 ] || { echo "wheelhouse.sh: OUT_DIR is required" >&2; usage 2; }
OUT="${POS[0]}"
PYVER="${POS[1]:-$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}"
PLATFORM="${POS[2]:-manylinux_2_28_x86_64}"
case "$PYVER" in 3.[0-9]|3.[0-9][0-9]) ;; *) echo "wheelhouse.sh: PYTHON_VERSION must look like 3.12, got '$PYVER'" >&2; exit 2 ;; esac
case "$CUDA" in cpu|cu[0-9][0-9][0-9]) ;; *) echo "wheelhouse.sh: --cuda must be cpu or cuXYZ (e.g. cu130), got '$CUDA'" >&2; exit 2 ;; esac
PYTAG="cp${PYVER/./}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

# pip accepts several --platform values; a manylinux_2_X platform also takes the older manylinux tags
PLATS=(--platform "$PLATFORM")
if [[ "$PLATFORM" =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
  glibc="${BASH_REMATCH[1]}"; arch="${BASH_REMATCH[2]}"
  for g in $(seq "$glibc" -1 17); do PLATS+=(--platform "manylinux_2_${g}_${arch}"); done
  PLATS+=(--platform "manylinux2014_${arch}")
  [ "$arch" = x86_64 ] && PLATS+=(--platform manylinux2010_x86_64 --platform manylinux1_x86_64)
fi
TARGET=(--only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$PYTAG" --abi abi3 --abi none "${PLATS[@]}")

echo "== attnlab wheel"
rm -f "$OUT"/attnlab-*.whl
"$PYTHON" -m pip wheel --no-deps --no-build-isolation -q -w "$OUT" "$REPO" 2>/dev/null \
  || "$PYTHON" -m pip wheel --no-deps -q -w "$OUT" "$REPO"
WHEEL="$(ls "$OUT"/attnlab-*.whl | head -1)"
SPEC="$WHEEL"; [ -n "$EXTRAS" ] && SPEC="attnlab[$EXTRAS] @ file://$WHEEL"

EXTRA_PIP=()
if [ "$NO_TORCH" = 1 ]; then
  # torch/triton are left out: resolve against stub wheels that carry torch's pure-Python requirements,
  # then delete the stubs. A "+stub" local version never exists on an index, so only the stubs match.
  STUBS="$(mktemp -d)"
  trap 'rm -rf "$STUBS"' EXIT
  "$PYTHON" - "$STUBS" "$TORCH_VERSION" <<'EOF'
import sys, zipfile
out, ver = sys.argv[1], sys.argv[2]
deps = {"torch": ["filelock", "typing-extensions>=4.10.0", "setuptools", "sympy>=1.13.3", "networkx>=2.5.1",
                  "jinja2", "fsspec>=0.8.5"], "triton": []}
for name, req in deps.items():
    v = f"{ver}+stub" if name == "torch" else "99.0.0+stub"
    di = f"{name}-{v}.dist-info"
    with zipfile.ZipFile(f"{out}/{name}-{v}-py3-none-any.whl", "w") as z:
        z.writestr(f"{di}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {v}\n"
                   + "".join(f"Requires-Dist: {r}\n" for r in req))
        z.writestr(f"{di}/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{di}/RECORD", "")
EOF
  EXTRA_PIP+=(--find-links "$STUBS" "torch==${TORCH_VERSION}+stub" "triton==99.0.0+stub")
else
  EXTRA_PIP+=(--extra-index-url "https://download.pytorch.org/whl/${CUDA}" "torch==${TORCH_VERSION}")
  if [ "$CUDA" != cpu ] || [[ "$PLATFORM" == *x86_64* ]]; then EXTRA_PIP[-1]="torch==${TORCH_VERSION}+${CUDA}"; fi
fi

echo "== dependency closure for python $PYVER on $PLATFORM (torch: $([ "$NO_TORCH" = 1 ] && echo left out || echo "$TORCH_VERSION/$CUDA"))"
"$PYTHON" -m pip download --dest "$OUT" "${TARGET[@]}" --progress-bar off \
  "$SPEC" "torchtitan==0.2.2" torchao torchdata datasets tokenizers tomli numpy "${EXTRA_PIP[@]}"
rm -f "$OUT"/torch-*+stub-*.whl "$OUT"/triton-99.0.0+stub-*.whl

cat > "$OUT/install.sh" <<EOF
#!/usr/bin/env bash
# Offline install of attnlab from this folder (built for python $PYVER, $PLATFORM, torch $([ "$NO_TORCH" = 1 ] && echo "not included" || echo "$TORCH_VERSION/$CUDA")).
#   bash install.sh [PIP_ARGS...]        e.g. bash install.sh --user, or inside an activated venv
# Uses no package index and ignores pip configuration files, so nothing outside this folder is consulted.
set -euo pipefail
HERE="\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)"
PY="\${PYTHON:-python3}"
EXTRAS="$EXTRAS"
SPEC="attnlab"; [ -n "\$EXTRAS" ] && SPEC="attnlab[\$EXTRAS]"
env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \\
  "\$PY" -m pip install --no-index --find-links "\$HERE" "\$@" "\$SPEC"
EOF
chmod +x "$OUT/install.sh"
n=$(ls "$OUT"/*.whl | wc -l)
echo "== $n wheels, $(du -sh "$OUT" | cut -f1) in $OUT; install offline with: bash $OUT/install.sh"
