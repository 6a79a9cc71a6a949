# Sourced by every *_runs.sh here: strict mode, the repository root as the working directory, the
# interpreter (`$PY`, default the venv's) and one thread per rank (each run's ranks share the cores).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1
