#!/usr/bin/env bash
# The import contracts (pyproject.toml [tool.importlinter]) on the installed layout: the code
# folders are mapped under one import root, which import-linter cannot follow, so they are
# assembled into one package tree first (a copy, so nothing in the repo changes).
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/mindpulse"
cp mindpulse/*.py "$tree/mindpulse/"
for pkg in launcher node workers aggregator views; do
  mkdir -p "$tree/mindpulse/$pkg" && (cd "$pkg" && find . -name "*.py" -exec cp --parents {} "$tree/mindpulse/$pkg/" \;)
done
# run from the assembled tree: import-linter puts the working directory first on sys.path
repo=$(pwd)
cd "$tree"
PYTHONPATH="$tree" "${LINT_IMPORTS:-$repo/.venv/bin/lint-imports}" --no-cache "$repo/pyproject.toml"
