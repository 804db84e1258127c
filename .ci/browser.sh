#!/usr/bin/env bash
# Debian's Chromium for the page's browser tests (tests/test_ui_browser.py), which fail under CI=true
# without one: installed with apt-get when missing, quietly; a machine without apt-get is told why.
set -uo pipefail
command -v chromium >/dev/null 2>&1 && exit 0
if command -v apt-get >/dev/null 2>&1; then
  apt-get install -y -qq chromium >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }
fi
command -v chromium >/dev/null 2>&1 \
  || echo "chromium unavailable (apt-get install -y chromium, or set CHROMIUM): the browser tests of the page will fail" >&2
exit 0
