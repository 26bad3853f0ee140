#!/usr/bin/env bash
# Headless Chromium for the tests that render report.html in a real browser.
# Installed from Debian's package when missing and apt-get may be used (root);
# otherwise those tests skip and say why (tests/conftest.py finds the binary).
set -euo pipefail
for name in chromium chromium-browser google-chrome; do
    if command -v "$name" >/dev/null 2>&1; then
        echo "[setup browser] $("$name" --version 2>/dev/null | head -1) ($(command -v "$name"))"
        exit 0
    fi
done
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "[setup browser] skipped: no chromium and no root apt-get; the browser tests will skip"
    exit 0
fi
echo "[setup browser] installing Debian's chromium (apt-get)"
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends chromium; } >/tmp/mmnanhook-apt.log 2>&1; then
    echo "[setup browser] skipped: apt-get failed (/tmp/mmnanhook-apt.log); the browser tests will skip"
    exit 0
fi
echo "[setup browser] $(chromium --version 2>/dev/null | head -1)"
