#!/usr/bin/env bash
# Installs (or removes) the appliance as a systemd service; `sudo make install` / `sudo make uninstall` run it.
#
#   systemd/install.sh install   [--root DIR] [--prefix DIR]
#   systemd/install.sh uninstall [--root DIR] [--purge]
#
# install: the `appliance` system user (sysusers.d entry, in the render and video groups for /dev/dri and
# /dev/accel), /etc/appliance/appliance.env (from systemd/appliance.env) and /etc/appliance/api-keys (a random
# key), /var/lib/appliance/models (owned by root: the service only reads models), /var/lib/appliance/state (the
# service's: the Responses store, pulled models, the KV disk tier; the unit's StateDirectory), the unit with
# ExecStart in --prefix (default: this checkout, whose .venv `make venv` built), enabled. The env file and the key
# are written once and never overwritten, so re-running it (after a `git pull`) only refreshes the unit. The state
# dir is made once and never touched again: a re-install changes no owner, mode or byte under it. No network: the
# code and the model come from `make venv` and `make model` (docs/deploy.md, "Install as a systemd service").
#
# The unit goes in /usr/local/lib/systemd/system: systemd's directory for units installed by the local admin
# from outside a package, the vendor layer. /etc/systemd/system is the admin's own layer, above it: drop-ins
# there (`systemctl edit appliance`, /etc/systemd/system/appliance.service.d/) survive a re-install, a full copy
# there overrides ours, and `systemctl revert appliance` goes back to ours. An older install put the unit in
# /etc/systemd/system; a re-install removes that copy only when it is byte for byte a unit this checkout shipped
# (any version in its git history): anything else there is an admin's `systemctl edit --full`, kept, with a line.
#
# uninstall: disables and removes the unit and the sysusers.d entry; --purge also deletes /etc/appliance,
# /var/lib/appliance, /var/cache/appliance and the unit's drop-ins (/etc/systemd/system/appliance.service.d).
# The system user is kept (as packages do: files may still carry its uid); `userdel appliance` removes it.
#
# Run as root, it trusts nothing it did not make: a directory it writes in (/etc/appliance, /var/lib/appliance,
# the unit's and sysusers.d's) must not be a symlink nor writable by another user, or it stops with one line
# (a user who could write there could plant a link and have root write, chmod or chown any file); files are
# made under a random name (mktemp: O_EXCL, mode 0600) and renamed into place, and chown never follows a link.
# The code the unit runs (--prefix, everything in it including .venv, and the venv's Python) must be root's and
# not writable by others: whoever can write it runs code as the service, and as root at the next `sudo make`
# there. A new API key is not printed (install logs keep stderr): the message says which file holds it.
#
# --root DIR (or DESTDIR=DIR): everything under DIR instead of /, systemd not contacted (`systemctl --root`):
# how tests/deploy/test_systemd.py installs into a temporary root. Run by a user other than root (only allowed with
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
STATE=$DATA/state                  # the unit's StateDirectory=appliance/state
CACHE=$R/var/cache/$NAME

OWNER=$(id -u)   # who must own what install.sh writes in and runs: root, or the user of a staging install

# The one-line reason a path is unsafe for root to write in or run from: a symlink, owned by another user, or
# writable by every user (by its group too unless that is root's group). Prints nothing when it is safe.
unsafe() {
    local path=$1 uid gid mode
    if [ -L "$path" ]; then echo "is a symlink"; return; fi
    [ -e "$path" ] || return 0
    read -r uid gid mode < <(stat -c '%u %g %a' "$path")
    if [ "$uid" != "$OWNER" ]; then echo "belongs to uid $uid, not $OWNER"; return; fi
    if (( 8#$mode & 8#002 )); then echo "is writable by every user (mode $mode)"; return; fi
    if (( 8#$mode & 8#020 )) && [ "$gid" != 0 ] && [ $AS_ROOT -eq 1 ]; then
        echo "is writable by group $gid (mode $mode)"
    fi
}

# Refuses (one line) a directory install.sh writes in that is unsafe, or not a directory.
check_dir() {
    local why
    why=$(unsafe "$1")
    [ -z "$why" ] && { [ ! -e "$1" ] || [ -d "$1" ]; } || why=${why:-is not a directory}
    [ -z "$why" ] || die "$1 $why: install.sh writes there as root; make it a directory only uid $OWNER" \
        "writes (chown $OWNER $1; chmod go-w $1), or remove it"
}

# Refuses (one line) code the unit would run that someone else may change: the prefix and the directories above
# it (in the root), everything in the prefix (the checkout, its .venv), and the Python the venv links to.
check_code() {
    local top=$R$PREFIX path why bad
    [ $SYSTEM_ROOT -eq 0 ] || top=$(readlink -f "$PREFIX")   # the real directories, links resolved
    path=$top
    while [ "$path" != "$R" ] && [ "$path" != / ] && [ "$path" != . ]; do
        why=$(unsafe "$path")
        [ -z "$why" ] || die "$path $why: the service would run code that others can change" \
            "(chown $OWNER $path; chmod go-w $path)"
        path=$(dirname "$path")
    done
    bad=$(find "$top/" \( ! -user "$OWNER" -o \( ! -type l -perm -0002 \) \) -print -quit) || die "cannot check $top"
    if [ -z "$bad" ] && [ $AS_ROOT -eq 1 ]; then
        bad=$(find "$top/" ! -type l -perm -0020 ! -group 0 -print -quit) || die "cannot check $top"
    fi
    [ -z "$bad" ] || die "$bad: not uid $OWNER's, or writable by others: the service (and root, at the next" \
        "\`sudo make\` there) would run code that others can change (chown -R $OWNER:0 $PREFIX; chmod -R go-w $PREFIX)"
    if [ -L "$top/.venv/bin/python" ]; then
        local python
        python=$(readlink -f "$top/.venv/bin/python")
        why=$(unsafe "$python")
        [ -z "$why" ] || [ "$OWNER" != 0 ] || \
            die "$python (the venv's Python) $why: others can change what the service runs"
    fi
}

# put DEST MODE [OWNER] < content: DEST written atomically: a fresh file beside it (mktemp: O_EXCL, mode 0600),
# its mode and owner set, then renamed over DEST (a symlink at DEST is replaced, never written through).
put() {
    local dest=$1 mode=$2 owner=${3:-} tmp
    tmp=$(mktemp "$(dirname "$dest")/.$(basename "$dest").XXXXXX")
    if cat >"$tmp" && chmod "$mode" "$tmp" && { [ -z "$owner" ] || chown -h "$owner" "$tmp"; } \
        && mv -fT "$tmp" "$dest"; then
        return 0
    fi
    rm -f "$tmp"
    die "could not write $dest"
}

present() { [ -e "$1" ] || [ -L "$1" ]; }   # a dangling symlink is there too: kept, never written through

# Whether FILE is byte for byte a unit this checkout shipped, as install.sh wrote it (the code path set to
# --prefix): the current one or any earlier version in git (without git: only the current one).
shipped_unit() {
    local file=$1 commit
    sed "s|/opt/appliance|$PREFIX|g" "$HERE/$NAME.service" | cmp -s - "$file" && return 0
    git -C "$HERE" rev-parse --git-dir >/dev/null 2>&1 || return 1
    for commit in $(git -C "$HERE" log --format=%H -- "$NAME.service" 2>/dev/null); do
        git -C "$HERE" show "$commit:./$NAME.service" 2>/dev/null | sed "s|/opt/appliance|$PREFIX|g" \
            | cmp -s - "$file" && return 0
    done
    return 1
}

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
    check_code
    local dir
    for dir in "$R/etc/sysusers.d" "$R/etc/systemd/system" "$UNIT_DIR" "$DATA" "$DATA/models" "$CONF"; do
        check_dir "$dir"
    done

    install -d -m 0755 "$R/etc/sysusers.d" "$R/etc/systemd/system" "$UNIT_DIR" "$DATA" "$DATA/models"
    put "$SYSUSERS" 0644 <<EOF
# The appliance service's user (systemd/install.sh); render and video open /dev/dri and /dev/accel.
u $NAME - "Appliance LLM server" /var/lib/$NAME
m $NAME render
m $NAME video
EOF
    local group=
    if [ $AS_ROOT -eq 1 ]; then
        systemd-sysusers --root="$ROOT" "$SYSUSERS"
        group=$(awk -F: -v name="$NAME" '$1 == name { print $3 }' "$R/etc/group")  # by number: --root's own
        [ -n "$group" ] || die "systemd-sysusers made no $NAME group in $R/etc/group"
    else
        say "not root: staging install, the $NAME user is not created and files keep your ownership"
    fi

    install -d -m 0750 "$CONF"
    # The service reads its settings and keys (group), never writes them; models are root's, world-readable.
    local owner=${group:+0:$group}
    [ -z "$owner" ] || chown -h "$owner" "$CONF"
    if ! present "$ENV_FILE"; then
        put "$ENV_FILE" 0640 "$owner" <"$HERE/$NAME.env"
    else
        say "kept $ENV_FILE (compare with $HERE/$NAME.env for new settings)"
        [ -z "$owner" ] || chown -h "$owner" "$ENV_FILE"
    fi
    local new_key=0
    if ! present "$KEYS"; then
        printf '%s\n' "$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')" | put "$KEYS" 0640 "$owner"
        new_key=1
    else
        [ -z "$owner" ] || chown -h "$owner" "$KEYS"
    fi
    # Models: root's, readable by all (what `make model` leaves may carry another umask). Only the models: the state
    # dir beside them is the service's, and a recursive chown/chmod over it would make its conversations
    # world-readable and unwritable by the service.
    [ -z "$group" ] || chown -h 0:0 "$DATA"
    chmod u+rwx,go+rx,go-w "$DATA"
    [ -z "$group" ] || chown -hR 0:0 "$DATA/models"
    chmod -R u+rwX,go+rX,go-w "$DATA/models"
    if ! present "$STATE"; then  # made once (systemd would make it at the first start too), never touched again
        install -d -m 0700 "$STATE"
        if [ -n "$group" ]; then
            chown -h "$(awk -F: -v name="$NAME" '$1 == name { print $3 }' "$R/etc/passwd"):$group" "$STATE"
        fi
    fi

    if [ -e "$OLD_UNIT" ]; then  # an older install's copy, or the admin's full edit (the header says which goes)
        if shipped_unit "$OLD_UNIT"; then
            systemctl_ disable "$NAME.service" 2>/dev/null || true   # its wants link points at it
            rm -f "$OLD_UNIT"
            say "removed $OLD_UNIT, an older install's copy (local changes go in drop-ins: systemctl edit $NAME)"
        else
            say "kept $OLD_UNIT: a full copy of the unit (systemctl edit --full) that overrides the one installed" \
                "now; \`systemctl revert $NAME\` goes back to the installed one"
        fi
    fi
    sed "s|/opt/appliance|$PREFIX|g" "$HERE/$NAME.service" | put "$UNIT" 0644
    [ $LIVE -eq 0 ] || systemctl daemon-reload
    systemctl_ enable "$NAME.service"
    [ $LIVE -eq 0 ] || systemctl try-restart "$NAME.service"

    say "installed $UNIT (ExecStart $PREFIX/.venv/bin/$NAME serve), settings in $ENV_FILE"
    if [ $new_key -eq 1 ]; then  # not printed: install logs keep stderr
        say "API key: a new random key in $KEYS (clients send 'Authorization: Bearer <key>'; sudo cat $KEYS)"
    else
        say "API keys: $KEYS (kept)"
    fi
    if [ ! -e "$DATA/models/smollm2-135m-instruct/openvino-int4/appliance_manifest.json" ]; then
        say "no default model in $DATA: build it with \`sudo make model DATA_DIR=/var/lib/$NAME\` in $PREFIX"
    fi
    # what `make model` built the exports from: the service never reads it (docs/deploy.md, "State")
    local unread
    unread=$(find "$DATA/models" -mindepth 2 -maxdepth 2 -type d \( -name hf -o -path "*/all-minilm-l6-v2/openvino-fp32" \) \
        2>/dev/null | sort | tr '\n' ' ')
    if [ -n "$unread" ]; then
        # shellcheck disable=SC2086 # one path per word
        say "$(du -sch $unread | tail -1 | cut -f1) in folders make model built from, which the service never" \
            "reads: sudo rm -rf ${unread% }"
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
        say "removed the service; kept $CONF (settings, API keys) and $DATA (models; state/: stored responses," \
            "pulled models, the KV disk tier): --purge deletes them"
    fi
}

"do_$ACTION"
