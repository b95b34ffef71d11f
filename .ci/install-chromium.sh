#!/usr/bin/env bash
# Debian's Chromium for the dashboard's browser tests (tests/dashboard), installed only when
# /usr/bin/chromium is missing. The tests launch it through Playwright's Python package with
# executable_path; Playwright's own browser downloads (`playwright install`) are never used.
set -euo pipefail

CHROMIUM=/usr/bin/chromium
if [ -x "$CHROMIUM" ]; then
    echo "install-chromium: $CHROMIUM is present"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y chromium

if [ ! -x "$CHROMIUM" ]; then
    echo "install-chromium: apt-get finished but $CHROMIUM is still missing" >&2
    exit 1
fi
echo "install-chromium: installed $CHROMIUM"
