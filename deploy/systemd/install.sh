#!/usr/bin/env bash
# Installs the pjrt-rendezvous coordinator as a systemd service on this machine (run as
# root on host 0 / TPU worker 0). Idempotent: run it again to upgrade.
#
#   sudo deploy/systemd/install.sh                   # the checkout this script is in
#   sudo deploy/systemd/install.sh /path/to/checkout # or another source tree, or a built wheel
#
# pjrt-rendezvous is not published on PyPI yet: it is installed from a source tree or a wheel.
# Then edit /etc/pjrt-rendezvous/coordinator.env and `systemctl restart pjrt-rendezvous`.
set -euo pipefail

PREFIX=/opt/pjrt-rendezvous
CONFIG=/etc/pjrt-rendezvous
HERE="$(cd "$(dirname "$0")" && pwd)"
CHECKOUT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"

# What to install: the argument, else the checkout this script sits in (deploy/systemd/).
if [[ $# -gt 0 ]]; then
  SOURCE="$1"
elif [[ -f "$CHECKOUT/pyproject.toml" ]] && grep -q '^name = "pjrt-rendezvous"$' "$CHECKOUT/pyproject.toml"; then
  SOURCE="$CHECKOUT"
else
  echo "install.sh: no source given and $HERE is not inside a pjrt-rendezvous checkout; pass a checkout or a wheel (pjrt-rendezvous is not on PyPI yet): install.sh /path/to/pjrt-rendezvous" >&2
  exit 2
fi
if [[ -d "$SOURCE" ]]; then
  SOURCE="$(cd "$SOURCE" && pwd)"
  [[ -f "$SOURCE/pyproject.toml" ]] || {
    echo "install.sh: $SOURCE has no pyproject.toml; pass a pjrt-rendezvous checkout or a wheel" >&2
    exit 2
  }
elif [[ ! ( -f "$SOURCE" && "$SOURCE" == *.whl ) ]]; then
  echo "install.sh: $SOURCE is neither a folder nor a .whl file; pass a pjrt-rendezvous checkout or a wheel (it is not on PyPI yet)" >&2
  exit 2
fi

if [[ $EUID -ne 0 ]]; then
  echo "install.sh: run as root (sudo)" >&2
  exit 1
fi

"$PYTHON" -m venv "$PREFIX" || {
  echo "install.sh: '$PYTHON -m venv' failed; on Debian/Ubuntu: apt-get install -y python3-venv" >&2
  exit 1
}
"$PREFIX/bin/pip" install --quiet --upgrade pip
if [[ -d "$SOURCE" ]]; then
  # Built from a copy: pip builds a folder in place, which would leave root-owned build/ and
  # *.egg-info in the checkout (a later build there as its user then fails on them).
  BUILD="$(mktemp -d)"
  trap 'rm -rf "$BUILD"' EXIT
  tar -C "$SOURCE" --exclude=./.git --exclude=./build --exclude='./*.egg-info' -cf - . | tar -C "$BUILD" -xf -
  "$PREFIX/bin/pip" install --quiet --upgrade "$BUILD"
else
  "$PREFIX/bin/pip" install --quiet --upgrade "$SOURCE"
  # A wheel of the version installed is skipped by pip: install the rebuilt one anyway.
  "$PREFIX/bin/pip" install --quiet --force-reinstall --no-deps "$SOURCE"
fi
"$PREFIX/bin/pjrt-rendezvous" --version
ln -sf "$PREFIX/bin/pjrt-rendezvous" /usr/local/bin/pjrt-rendezvous  # status and health on PATH

install -d -m 0755 "$CONFIG"
if [[ ! -e "$CONFIG/coordinator.env" ]]; then
  install -m 0600 "$HERE/coordinator.env" "$CONFIG/coordinator.env"
fi
install -m 0644 "$HERE/pjrt-rendezvous.service" /etc/systemd/system/pjrt-rendezvous.service
systemctl daemon-reload
systemctl enable pjrt-rendezvous.service
# Type=notify: this returns once the coordinator listens (READY=1), and fails (the reason in
# `journalctl -u pjrt-rendezvous`) when it cannot start. (Not `health`: it would need the
# unit's settings, which systemd reads from coordinator.env otherwise than a shell does, and
# with TLS the client's certificate variables, which sudo does not pass.)
systemctl restart pjrt-rendezvous.service
systemctl is-active --quiet pjrt-rendezvous.service
systemctl --no-pager status pjrt-rendezvous.service | head -n 5 || true
