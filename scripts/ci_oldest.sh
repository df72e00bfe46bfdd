#!/usr/bin/env bash
# CI step for the oldest supported pair: the tests marked `exactness` on the lowest TensorFlow and
# Keras that pyproject.toml admits, in a virtual environment of their own (the newest pair is the
# one the main test run has).
#
# The environment lives in ${XDG_CACHE_HOME:-$HOME/.cache}/gacli-ci/venv-oldest and is reused
# while its Python and pins are the ones below; gacli and its dependencies are installed from this
# checkout on every run, constrained to the pins, so a dependency pyproject.toml adds comes in and
# a declared range that no longer admits the oldest pair fails here.
set -euo pipefail
cd "$(dirname "$0")/.."

# The oldest pair: the newest patch of the lowest TensorFlow in pyproject.toml, and the lowest
# Keras there (TensorFlow 2.17 itself accepts keras>=3.2; docs/versions.md says why
# gacli needs 3.11).
TENSORFLOW=2.17.1
KERAS=3.11.0
PYTHON=${PYTHON:-python3}

cache=${XDG_CACHE_HOME:-$HOME/.cache}/gacli-ci
venv=$cache/venv-oldest
stamp="python=$("$PYTHON" -c 'import sys; print(sys.version.split()[0])') tensorflow=$TENSORFLOW keras=$KERAS"

say() { printf '[ci-oldest] %s\n' "$*"; }
elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f s", b - a }'; }

start=$EPOCHREALTIME
if [ -f "$venv/.gacli-pins" ] && [ "$(cat "$venv/.gacli-pins")" = "$stamp" ] \
        && "$venv/bin/python" -c '' 2>/dev/null; then
    say "reusing $venv ($stamp)"
else
    say "creating $venv ($stamp)"
    rm -rf "$venv"
    mkdir -p "$cache"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'tensorflow==%s\nkeras==%s\n' "$TENSORFLOW" "$KERAS" >"$constraints"
# Not editable: the tests run against the package as a user installs it.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" ".[test]"
# The stamp is written only once the pins are installed: an interrupted install starts afresh.
echo "$stamp" >"$venv/.gacli-pins"
"$venv/bin/python" - <<'EOF'
import importlib.metadata as metadata

print("[ci-oldest] installed: " + ", ".join(
    f"{name} {metadata.version(name)}" for name in ("tensorflow", "keras", "tensorboard", "numpy")
))
EOF
say "environment ready in $(elapsed "$start")"

start=$EPOCHREALTIME
status=0
"$venv/bin/pytest" -m exactness || status=$?
say "exactness tests on TensorFlow $TENSORFLOW / Keras $KERAS: $(elapsed "$start"), exit $status"
exit "$status"
