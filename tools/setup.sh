#!/usr/bin/env bash
# One-step environment for SlicerNeuralRaycast, called by `make demo` and `make test`.
#
# 1. Where no NVIDIA GPU answers, make sure a Vulkan driver that slangpy can use is installed:
#    Mesa's lavapipe (a CPU Vulkan implementation) >= 23. Debian bookworm ships 22.3, which is too old,
#    so bookworm-backports is enabled by adding its suite to the existing apt source entry.
# 2. Make sure Chromium is installed (Debian's `chromium`): the test of `neuralraycast share` opens the page in
#    it, headless, with WebGPU on SwiftShader (the CPU). Where it cannot be installed that test is skipped.
# 3. Create or refresh the virtual environment `.venv` from the pinned `requirements.lock` (Ray included, for
#    the cohort test's local cluster) and install NeuralRaycastLib into it (editable), so the `neuralraycast`
#    command exists.
#
# Re-running is cheap: each step is skipped when already satisfied.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NEURALRAYCAST_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
MIN_MESA=23

log() { printf '[setup] %s\n' "$*" >&2; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
        log "need root to run: $*  (no sudo found)"; return 1
    fi
}

have_nvidia_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

mesa_version() { dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || true; }

enable_backports() {
    # Extend the suites of the existing Debian entry instead of writing a new source line.
    local deb822=/etc/apt/sources.list.d/debian.sources
    if grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then return; fi
    if [ -f "$deb822" ] && grep -q '^Suites:.*\bbookworm-updates\b' "$deb822"; then
        log "enabling bookworm-backports in $deb822"
        as_root sed -i -E '/^Suites:.*\bbookworm-updates\b/ s/$/ bookworm-backports/' "$deb822"
    elif grep -qs '^deb .* bookworm main' /etc/apt/sources.list; then
        log "enabling bookworm-backports in /etc/apt/sources.list"
        as_root sed -i -E '0,/^deb (.*) bookworm main(.*)$/ s//&\ndeb \1 bookworm-backports main\2/' /etc/apt/sources.list
    else
        log "could not find the Debian bookworm apt source to extend with bookworm-backports"
        return 1
    fi
}

ensure_vulkan_driver() {
    if have_nvidia_gpu; then
        log "NVIDIA GPU found: using its driver (CUDA first, Vulkan as fallback)"
        return
    fi
    if ! command -v dpkg-query >/dev/null; then
        log "not a Debian system: install Mesa >= $MIN_MESA with its Vulkan drivers (lavapipe) yourself"
        return
    fi
    local have; have="$(mesa_version)"
    if [ -n "$have" ] && dpkg --compare-versions "$have" ge "$MIN_MESA"; then
        log "Vulkan software driver present (mesa-vulkan-drivers $have)"
        return
    fi
    log "no GPU and no recent lavapipe (found '${have:-none}'): installing Mesa from bookworm-backports"
    enable_backports
    as_root apt-get update -qq
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq -t bookworm-backports \
        mesa-vulkan-drivers libvulkan1 >/dev/null
    log "installed mesa-vulkan-drivers $(mesa_version)"
}

ensure_chromium() {
    local name
    for name in chromium chromium-browser google-chrome; do
        if command -v "$name" >/dev/null; then log "browser for the page test present ($name)"; return; fi
    done
    if ! command -v apt-get >/dev/null; then
        log "not a Debian system: install Chromium yourself to run the page test (it is skipped without it)"
        return
    fi
    log "installing chromium (for the page test)"
    if ! { as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq chromium >/dev/null; }; then
        log "could not install chromium: the page test will be skipped"
    fi
}

ensure_venv() {
    local lock="$ROOT/requirements.lock" stamp="$VENV/.neuralraycast-lock"
    local want; want="$(cat "$lock" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
        log "virtual environment up to date ($VENV)"
        return
    fi
    log "creating/refreshing virtual environment $VENV"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -r "$lock"
    "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
    echo "$want" >"$stamp"
}

ensure_vulkan_driver
ensure_chromium
ensure_venv
log "ready: $VENV/bin/neuralraycast"
