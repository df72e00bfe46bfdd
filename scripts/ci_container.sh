#!/usr/bin/env bash
# CI step for the container: installs Podman and debootstrap from the distribution when they are
# missing (Debian/Ubuntu, as root), then runs the container smoke test. On a machine where they
# cannot be installed the smoke test reports that it skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
for tool in podman runc debootstrap; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ] && [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    start=$EPOCHREALTIME
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null
    awk -v a="$start" -v b="$EPOCHREALTIME" \
        'BEGIN { printf "[container-smoke] %-52s %7.1f s\n", "apt-get install podman runc debootstrap", b - a }'
fi
exec scripts/container_smoke.sh
