#!/usr/bin/env bash
# The import contracts (pyproject.toml [tool.importlinter]) on the installed layout: the code
# folders are mapped under one import root, which import-linter cannot follow, so they are
# assembled into one package tree first (a copy, so nothing in the repo changes).
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
copy_py() {  # every .py file under folder $1, subfolders included, into $2 at the same relative paths
  mkdir -p "$2" && (cd "$1" && find . -name "*.py" -exec cp --parents {} "$2/" \;)
}
# the shared base and its subpackages (mindpulse/config/, ...), then each code folder once, under its name
copy_py mindpulse "$tree/mindpulse"
for pkg in launcher node workers aggregator views; do
  copy_py "$pkg" "$tree/mindpulse/$pkg"
done
# run from the assembled tree: import-linter puts the working directory first on sys.path
repo=$(pwd)
cd "$tree"
PYTHONPATH="$tree" "${LINT_IMPORTS:-$repo/.venv/bin/lint-imports}" --no-cache "$repo/pyproject.toml"
