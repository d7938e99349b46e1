#!/usr/bin/env bash
# Installs the Debian packages the test suite needs, when they are missing:
# a PostgreSQL server (initdb/pg_ctl), redis-server, and chromium with fonts (browser tests).
set -euo pipefail

missing=()
have_postgres() {
    command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}
have_postgres || missing+=(postgresql)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
# Chromium only recommends fonts; without them pages render as boxes in screenshots.
dpkg -s fonts-liberation >/dev/null 2>&1 || missing+=(fonts-liberation)

if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "loramux tests need these Debian packages: ${missing[*]}" >&2
    echo "Install them as root:  sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
echo "Installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
