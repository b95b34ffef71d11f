#!/usr/bin/env bash
# Debian's Chromium for the dashboard's browser tests (tests/dashboard), installed only when
# it is missing. The tests launch it through Playwright's Python package with
# executable_path; Playwright's own browser downloads (`playwright install`) are never used.
# AGENTBOLT_CHROMIUM names another binary (the dashboard tests read the same variable).
#
# When apt cannot install it, this prints one line that says why and exits 1, instead of
# leaving a CI log that ends in apt's own output.
set -euo pipefail

CHROMIUM="${AGENTBOLT_CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
    echo "install-chromium: $CHROMIUM is present"
    exit 0
fi

fail() {
    echo "install-chromium: cannot install Chromium at $CHROMIUM: $1 (the dashboard tests need it; install it, or set AGENTBOLT_CHROMIUM to a Chromium binary)" >&2
    exit 1
}

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || fail "not root and no sudo to run apt-get"
    SUDO="sudo"
fi
command -v apt-get >/dev/null || fail "no apt-get on this machine (not Debian or Ubuntu)"

# apt's output goes to a log; on failure its last error line is the reason given.
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
apt_step() {
    local step="$1"
    shift
    if ! "$@" >"$LOG" 2>&1; then
        local reason
        reason="$(grep -E '^(E|W):' "$LOG" | tail -n 1 || true)"
        fail "'$step' failed${reason:+ ($reason)}"
    fi
}
export DEBIAN_FRONTEND=noninteractive
apt_step "apt-get update" $SUDO apt-get update
apt_step "apt-get install chromium" $SUDO apt-get install -y chromium

[ -x "$CHROMIUM" ] || fail "apt-get installed the chromium package but $CHROMIUM is still missing"
echo "install-chromium: installed $CHROMIUM"
