#!/usr/bin/env bash
# Installs (or removes) the appliance as a systemd service; `sudo make install` / `sudo make uninstall` run it.
#
#   systemd/install.sh install   [--root DIR] [--prefix DIR]
#   systemd/install.sh uninstall [--root DIR] [--purge]
#
# install: the `appliance` system user (sysusers.d entry, in the render and video groups for /dev/dri and
# /dev/accel), /etc/appliance/appliance.env (from systemd/appliance.env) and /etc/appliance/api-keys (a random
# key), /var/lib/appliance/models (owned by root: the service only reads models), the unit with ExecStart in
# --prefix (default: this checkout, whose .venv `make venv` built), enabled. The env file and the key are written
# once and never overwritten, so re-running it (after a `git pull`) only refreshes the unit. No network: the code
# and the model come from `make venv` and `make model` (docs/deploy.md, "Install as a systemd service").
#
# The unit goes in /usr/local/lib/systemd/system: systemd's directory for units installed by the local admin
# from outside a package, the vendor layer. /etc/systemd/system is the admin's own layer, above it: drop-ins
# there (`systemctl edit appliance`, /etc/systemd/system/appliance.service.d/) survive a re-install, a full copy
# there overrides ours, and `systemctl revert appliance` goes back to ours. An older install put the unit in
# /etc/systemd/system; a re-install removes that copy.
#
# uninstall: disables and removes the unit and the sysusers.d entry; --purge also deletes /etc/appliance,
# /var/lib/appliance, /var/cache/appliance and the unit's drop-ins (/etc/systemd/system/appliance.service.d).
# The system user is kept (as packages do: files may still carry its uid); `userdel appliance` removes it.
#
# --root DIR (or DESTDIR=DIR): everything under DIR instead of /, systemd not contacted (`systemctl --root`):
# how tests/test_systemd.py installs into a temporary root. Run by a user other than root (only allowed with
# --root), ownership is left to that user and the user is not created: a staging install, said on stderr.
set -euo pipefail

NAME=appliance
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
say() { printf 'install.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

[ $# -ge 1 ] || usage
ACTION=$1; shift
ROOT=${DESTDIR:-/}
PREFIX=$(dirname "$HERE")
PURGE=0
while [ $# -gt 0 ]; do
    case $1 in
        --root) [ $# -ge 2 ] || usage; ROOT=$2; shift 2 ;;
        --prefix) [ $# -ge 2 ] || usage; PREFIX=$2; shift 2 ;;
        --purge) PURGE=1; shift ;;
        *) usage ;;
    esac
done
case $ACTION in install|uninstall) ;; *) usage ;; esac

R=${ROOT%/}                        # "" for the real root: "$R/etc" is /etc
SYSTEM_ROOT=0; [ -z "$R" ] && SYSTEM_ROOT=1
AS_ROOT=0; [ "$(id -u)" -eq 0 ] && AS_ROOT=1
[ $AS_ROOT -eq 1 ] || [ $SYSTEM_ROOT -eq 0 ] || die "run as root (sudo make $ACTION), or give --root DIR"
[ $SYSTEM_ROOT -eq 1 ] || [ -d "$R" ] || die "--root $ROOT: no such directory"
LIVE=0; [ $SYSTEM_ROOT -eq 1 ] && [ -d /run/systemd/system ] && LIVE=1   # systemd is PID 1 here

UNIT_DIR=$R/usr/local/lib/systemd/system   # the vendor layer for local software (the header says why)
UNIT=$UNIT_DIR/$NAME.service
OLD_UNIT=$R/etc/systemd/system/$NAME.service  # where installs before this one put it
DROPINS=$R/etc/systemd/system/$NAME.service.d
SYSUSERS=$R/etc/sysusers.d/$NAME.conf
CONF=$R/etc/$NAME
ENV_FILE=$CONF/$NAME.env
KEYS=$CONF/api-keys
DATA=$R/var/lib/$NAME
CACHE=$R/var/cache/$NAME

systemctl_() {  # systemctl on the running manager, or offline on the files under --root
    if [ $LIVE -eq 1 ]; then systemctl "$@"; else systemctl --root="$ROOT" "$@"; fi
}

do_install() {
    case $PREFIX in
        /*) ;;
        *) die "--prefix $PREFIX: give an absolute path" ;;
    esac
    case $PREFIX/ in  # the unit's ProtectHome=yes hides these from the service
        /home/*|/root/*|/run/user/*) die "--prefix $PREFIX: the service cannot see /home, /root or /run/user" \
            "(ProtectHome=yes); put the checkout in /opt/$NAME, run \`make venv\` there, install from it" ;;
    esac
    if [ ! -x "$R$PREFIX/.venv/bin/$NAME" ]; then
        [ $SYSTEM_ROOT -eq 1 ] || die "$R$PREFIX/.venv/bin/$NAME is missing: the root $ROOT holds no venv at" \
            "$PREFIX (put the checkout and its venv there first, or give --prefix where they are in the root)"
        die "$PREFIX/.venv/bin/$NAME is missing: run \`make venv\` in $PREFIX first"
    fi
    if [ -L "$R$PREFIX/.venv/bin/python" ]; then  # a venv's python links to the one that made it (pyenv: ~/.pyenv)
        local python
        python=$(cd "$R$PREFIX/.venv/bin" && readlink -f python)
        case ${python#"$R"}/ in
            /home/*|/root/*) die "$PREFIX/.venv uses $python, which the service cannot see (ProtectHome=yes):" \
                "make the venv with a system Python (make venv PYTHON=/usr/bin/python3)" ;;
        esac
    fi

    install -d -m 0755 "$R/etc/sysusers.d" "$R/etc/systemd/system" "$UNIT_DIR" "$DATA" "$DATA/models"
    cat >"$SYSUSERS.tmp" <<EOF
# The appliance service's user (systemd/install.sh); render and video open /dev/dri and /dev/accel.
u $NAME - "Appliance LLM server" /var/lib/$NAME
m $NAME render
m $NAME video
EOF
    chmod 0644 "$SYSUSERS.tmp" && mv "$SYSUSERS.tmp" "$SYSUSERS"
    local group=
    if [ $AS_ROOT -eq 1 ]; then
        systemd-sysusers --root="$ROOT" "$SYSUSERS"
        group=$(awk -F: -v name="$NAME" '$1 == name { print $3 }' "$R/etc/group")  # by number: --root's own
        [ -n "$group" ] || die "systemd-sysusers made no $NAME group in $R/etc/group"
    else
        say "not root: staging install, the $NAME user is not created and files keep your ownership"
    fi

    install -d -m 0750 "$CONF"
    if [ ! -e "$ENV_FILE" ]; then
        install -m 0640 "$HERE/$NAME.env" "$ENV_FILE"
    else
        say "kept $ENV_FILE (compare with $HERE/$NAME.env for new settings)"
    fi
    local new_key=
    if [ ! -e "$KEYS" ]; then
        new_key=$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')
        (umask 077 && printf '%s\n' "$new_key" >"$KEYS.tmp")
        chmod 0640 "$KEYS.tmp" && mv "$KEYS.tmp" "$KEYS"
    fi
    if [ -n "$group" ]; then
        # The service reads its settings and keys (group), never writes them; models are root's, world-readable.
        chown "0:$group" "$CONF" "$ENV_FILE" "$KEYS"
        chown -R 0:0 "$DATA"
    fi
    chmod -R u+rwX,go+rX,go-w "$DATA"

    if [ -e "$OLD_UNIT" ]; then  # an older install's copy: it would override the one below
        systemctl_ disable "$NAME.service" 2>/dev/null || true   # its wants link points at it
        rm -f "$OLD_UNIT"
        say "removed $OLD_UNIT, an older install's copy (local changes go in drop-ins: systemctl edit $NAME)"
    fi
    sed "s|/opt/appliance|$PREFIX|g" "$HERE/$NAME.service" >"$UNIT.tmp"
    chmod 0644 "$UNIT.tmp" && mv "$UNIT.tmp" "$UNIT"
    [ $LIVE -eq 0 ] || systemctl daemon-reload
    systemctl_ enable "$NAME.service"
    [ $LIVE -eq 0 ] || systemctl try-restart "$NAME.service"

    say "installed $UNIT (ExecStart $PREFIX/.venv/bin/$NAME serve), settings in $ENV_FILE"
    if [ -n "$new_key" ]; then
        say "API key (also in $KEYS): $new_key"
    else
        say "API keys: $KEYS (kept)"
    fi
    if [ ! -e "$DATA/models/smollm2-135m-instruct/openvino-int4/appliance_manifest.json" ]; then
        say "no default model in $DATA: build it with \`sudo make model DATA_DIR=/var/lib/$NAME\` in $PREFIX"
    fi
    say "start: sudo systemctl start $NAME; logs: journalctl -u $NAME -f"
}

do_uninstall() {
    if [ -e "$UNIT" ] || [ -e "$OLD_UNIT" ]; then
        if [ $LIVE -eq 1 ]; then systemctl disable --now "$NAME.service" || true; else systemctl_ disable "$NAME.service"; fi
        rm -f "$UNIT" "$OLD_UNIT"
        [ $LIVE -eq 0 ] || systemctl daemon-reload
    fi
    rm -f "$SYSUSERS"
    if [ $PURGE -eq 1 ]; then
        rm -rf "$CONF" "$DATA" "$CACHE" "$DROPINS"
        [ $LIVE -eq 0 ] || systemctl daemon-reload
        say "removed the service, its drop-ins, settings, keys, models and compile cache (the $NAME user is kept)"
    else
        say "removed the service; kept $CONF (settings, API keys) and $DATA (models): --purge deletes them"
    fi
}

"do_$ACTION"
