#!/usr/bin/env bash
# Smoke test of the GPU image without a GPU and without a registry: builds a CPU-only stand-in for
# tensorflow/tensorflow:2.21.0-gpu (Debian 12 + TensorFlow 2.21 from PyPI, cached after the first
# build), builds this repository's Dockerfile on it, runs the default ga-train job as a non-root
# uid other than 1000 into a fresh host directory, and checks what lands there.
#
# Uses podman when installed, docker (with a running daemon) otherwise; exits 0 with a message
# when neither is usable. Building the stand-in needs root and debootstrap.
#
# Environment:
#   GACLI_SMOKE_BASE     base image to build on (default: the stand-in, built when missing),
#                        e.g. tensorflow/tensorflow:2.21.0-gpu where a registry is reachable
#   GACLI_SMOKE_IMAGE    tag of the project image (default localhost/gacli-smoke:latest)
#   GACLI_SMOKE_UID      uid:gid to run as when invoked as root (default 4321:4321)
#   GACLI_DEBIAN_MIRROR  Debian mirror for debootstrap (default: the one apt uses, if any)
#   GACLI_SMOKE_GPU=1    also pass the GPUs in and require TensorFlow to see one (GPU hosts only)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
standin=localhost/gacli-smoke-base:tf2.21.0-bookworm
base=${GACLI_SMOKE_BASE:-$standin}
image=${GACLI_SMOKE_IMAGE:-localhost/gacli-smoke:latest}

say() { printf '[container-smoke] %s\n' "$*"; }
fail() { say "FAIL: $*" >&2; exit 1; }

elapsed() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
script_start=$EPOCHREALTIME
step() {  # step NAME CMD...: runs CMD, prints its wall time, stops the script if it fails
    local name=$1 start rc=0
    shift
    start=$EPOCHREALTIME
    "$@" || rc=$?
    printf '[container-smoke] %-52s %7s s%s\n' "$name" "$(elapsed "$start")" \
        "$([ "$rc" -eq 0 ] || echo "  (exit $rc)")"
    [ "$rc" -eq 0 ] || fail "$name"
}
logged() {  # logged LOG CMD...: CMD's output goes to LOG, whose end is shown if CMD fails
    local log=$1 rc=0
    shift
    "$@" >"$log" 2>&1 || rc=$?
    [ "$rc" -eq 0 ] || tail -25 "$log" >&2
    return "$rc"
}

cleanup_paths=()
cleanup() { [ "${#cleanup_paths[@]}" -eq 0 ] || rm -rf "${cleanup_paths[@]}"; }
trap cleanup EXIT

# The host's CA bundle, for the stand-in's pip: on a network that re-signs TLS, the Debian
# bundle inside the image does not know the signing CA.
host_ca=
for f in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
    if [ -s "$f" ]; then host_ca=$f; break; fi
done

# --- the container runtime ---------------------------------------------------------------------
rt=()
run_opts=()    # options of every `run`
build_opts=()  # options of `build`
if command -v podman >/dev/null 2>&1; then
    rt=(podman)
    # Podman sets a nofile rlimit on each container by default, which a host that caps its own
    # limits refuses; an empty default list keeps the host's.
    if [ -z "${CONTAINERS_CONF:-}" ]; then
        conf=$(mktemp)
        cleanup_paths+=("$conf")
        printf '[containers]\ndefault_ulimits = []\n' >"$conf"
        export CONTAINERS_CONF=$conf
    fi
    # crun refuses hybrid cgroup hierarchies; runc does not. Without systemd as init there is no
    # systemd cgroup manager to talk to.
    if command -v runc >/dev/null 2>&1; then rt+=(--runtime runc); fi
    if [ ! -d /run/systemd/system ]; then rt+=(--cgroup-manager cgroupfs); fi
    build_opts+=(--network host)
    if [ -n "$host_ca" ]; then
        build_opts+=(--volume "$host_ca:/etc/ssl/certs/ca-certificates.crt:ro")
    fi
    if [ "$(id -u)" -ne 0 ]; then
        # Rootless: without keep-id, --user names a uid of the user namespace, not of the host.
        run_opts+=(--userns keep-id)
    fi
elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    rt=(docker)
else
    say "SKIPPED: no container runtime here (podman, or docker with a running daemon)."
    exit 0
fi
say "runtime: ${rt[*]}"

image_exists() {
    if [ "${rt[0]}" = podman ]; then "${rt[@]}" image exists "$1"
    else "${rt[@]}" image inspect "$1" >/dev/null 2>&1; fi
}

# --- the stand-in base -------------------------------------------------------------------------
build_standin() {
    [ "$(id -u)" -eq 0 ] || fail "building the stand-in base needs root (or set GACLI_SMOKE_BASE)"
    command -v debootstrap >/dev/null 2>&1 || fail "debootstrap is missing (apt-get install debootstrap)"
    local root mirror
    root=$(mktemp -d "${TMPDIR:-/var/tmp}/gacli-standin.XXXXXX")
    cleanup_paths+=("$root" "$root.log")
    mirror=${GACLI_DEBIAN_MIRROR:-}
    if [ -z "$mirror" ] && command -v apt-get >/dev/null 2>&1; then
        # shellcheck disable=SC2016  # apt's own $(FIELD) placeholders
        mirror=$(apt-get indextargets --format '$(SITE) $(RELEASE)' 'Identifier: Packages' 2>/dev/null \
            | awk '$2 == "bookworm" { print $1; exit }') || true
    fi
    # No python3-venv: the Dockerfile must not rely on ensurepip, which some bases lack.
    step "stand-in: debootstrap Debian 12" logged "$root.log" \
        debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates \
        bookworm "$root" ${mirror:+"$mirror"}
    rm -f "$root.log"
    # TensorFlow goes into the system Python, where the official image has it; Debian marks that
    # Python externally managed (PEP 668), so the stand-in also poses the problem the Dockerfile
    # has to solve on Ubuntu 24.04 bases.
    local debian_ca="$root/etc/ssl/certs/ca-certificates.crt"
    cp "$debian_ca" "$root/debian-ca.crt"
    if [ -n "$host_ca" ]; then cp "$host_ca" "$debian_ca"; fi
    # env -i: this host's pip settings (indexes, caches) mean nothing inside the chroot.
    step "stand-in: pip install tensorflow==2.21.0" logged "$root.log" \
        chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
        python3 -m pip install --no-cache-dir --break-system-packages --progress-bar off \
        "tensorflow==2.21.0"
    mv "$root/debian-ca.crt" "$debian_ca"
    # Ubuntu 24.04 images have a user with uid 1000 (ubuntu): so does the stand-in.
    chroot "$root" useradd --create-home --uid 1000 --user-group ubuntu
    rm -rf "${root:?}/tmp/"* "$root/root/.cache"
    # shellcheck disable=SC2016  # expanded by the inner bash
    step "stand-in: import as $standin" \
        logged "$root.log" bash -c 'tar --numeric-owner -C "$1" -c . | "${@:3}" import - "$2"' \
        _ "$root" "$standin" "${rt[@]}"
    step "stand-in: remove the build tree" rm -rf "$root" "$root.log"
}

work=$(mktemp -d)
cleanup_paths+=("$work")
step "container runtime ready" logged "$work/info.log" "${rt[@]}" info
if [ "$base" != "$standin" ]; then
    say "base image $base (the build pulls it if missing)"
elif image_exists "$base"; then
    say "base image $base present (cached)"
else
    build_standin
fi

# --- the project's image -----------------------------------------------------------------------
previous=$("${rt[@]}" image inspect --format '{{.Id}}' "$image" 2>/dev/null) || previous=
step "build $image" logged "$work/build.log" \
    "${rt[@]}" build "${build_opts[@]}" --build-arg "TF_IMAGE=$base" \
    -t "$image" -f "$repo/Dockerfile" "$repo"
# The image a code change replaced would stay behind untagged, 0.3 GB at each CI run.
if [ -n "$previous" ] && [ "$previous" != "$("${rt[@]}" image inspect --format '{{.Id}}' "$image")" ]; then
    "${rt[@]}" rmi "$previous" >/dev/null 2>&1 || true
fi
say "image size: $("${rt[@]}" image inspect --format '{{.Size}}' "$image" \
    | awk '{ printf "%.2f GB", $1 / 1e9 }')"

default_user() {
    local uid
    uid=$("${rt[@]}" run --rm --network none --entrypoint id "$image" -u) || return 1
    say "image's default uid: $uid"
    [ "$uid" != 0 ]
}
step "the image's default user is not root" default_user

# --- the default job, as the container guide runs it -------------------------------------------
if [ "$(id -u)" -eq 0 ]; then run_as=${GACLI_SMOKE_UID:-4321:4321}; else run_as="$(id -u):$(id -g)"; fi
run_uid=${run_as%%:*}
[ "$run_uid" != 0 ] && [ "$run_uid" != 1000 ] || say "note: running as uid $run_uid"
runs=$work/runs
# The container guide's `mkdir -p runs`, made by the user the container runs as.
mkdir -p "$runs"
chown "$run_as" "$runs"

gpu_opts=()
if [ "${GACLI_SMOKE_GPU:-0}" = 1 ]; then
    if [ "${rt[0]}" = podman ]; then gpu_opts=(--device nvidia.com/gpu=all); else gpu_opts=(--gpus all); fi
    step "TensorFlow sees a GPU" \
        "${rt[@]}" run --rm "${run_opts[@]}" "${gpu_opts[@]}" --user "$run_as" --entrypoint python \
        "$image" -c 'import sys, tensorflow as tf; sys.exit(not tf.config.list_physical_devices("GPU"))'
fi

step "ga-train (default job) in the container" logged "$work/job.log" \
    "${rt[@]}" run --rm --network none "${run_opts[@]}" "${gpu_opts[@]}" --user "$run_as" \
    -v "$runs:/runs" "$image"

check_outputs() {
    local f
    for f in result.json model.keras 'events.out.tfevents.*'; do
        [ -n "$(find "$runs/outputs" -name "$f" -type f -size +0)" ] || { say "missing: $f"; return 1; }
    done
    if [ -n "$(find "$runs" ! -uid "$run_uid" -print -quit)" ]; then
        say "not owned by uid $run_uid:"; find "$runs" ! -uid "$run_uid" -printf '  %u %p\n'; return 1
    fi
    # Nothing but the run's outputs: no .keras/ or caches from a home-less uid.
    if [ "$(ls -A "$runs")" != outputs ]; then say "extra entries: $(ls -A "$runs")"; return 1; fi
}
step "outputs on the host, owned by uid $run_uid" check_outputs

config_error() {
    local rc=0
    "${rt[@]}" run --rm --network none "${run_opts[@]}" --user "$run_as" -v "$runs:/runs" \
        "$image" accum_steps=0 >"$work/error.log" 2>&1 || rc=$?
    if [ "$rc" -ne 2 ]; then say "accum_steps=0 exited $rc, expected 2"; tail -20 "$work/error.log"; return 1; fi
}
step "config error (accum_steps=0) exits 2" config_error

printf '[container-smoke] %-52s %7s s\n' "PASSED, total" "$(elapsed "$script_start")"
