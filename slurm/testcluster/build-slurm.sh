#!/usr/bin/env bash
# Build Slurm from a source archive, once, into a prefix outside the repository, so that the test
# cluster can run on a release other than the system's (TESTCLUSTER_SLURM_PREFIX=PREFIX for
# start.sh, stop.sh and the tests). A prefix whose stamp matches the archive and the options is
# reused at once; the stamp is written last, so an interrupted build is redone, never half-used.
#
# Usage: build-slurm.sh [ARCHIVE]   (default: $SLURM_SOURCE; e.g. slurm-25.11.7.tar.gz)
# Prints the prefix, alone, on stdout; progress goes to stderr, the build's output to a log.
#
# Environment (all optional):
#   SLURM_SOURCE                  the archive, when not given as an argument
#   TESTCLUSTER_SLURM_BUILD_ROOT  where prefixes, logs and build folders go
#                                 (default ${XDG_CACHE_HOME:-$HOME/.cache}/slurm-ddp-kit)
#   TESTCLUSTER_VERBOSE=1         also print the tail of the log when the build succeeds
set -euo pipefail

die() { echo "testcluster: error: $*" >&2; exit 1; }
say() { echo "testcluster: $*" >&2; }

[[ $# -le 1 ]] || die "usage: $0 [ARCHIVE]"
ARCHIVE=${1:-${SLURM_SOURCE:-}}
[[ -n $ARCHIVE ]] || die "no Slurm source archive: give one, or set SLURM_SOURCE"
[[ -f $ARCHIVE ]] || die "$ARCHIVE: no such file"
ARCHIVE=$(cd "$(dirname "$ARCHIVE")" && pwd -P)/$(basename "$ARCHIVE")

ROOT=${TESTCLUSTER_SLURM_BUILD_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/slurm-ddp-kit}
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd -P)

# The archive unpacks to one folder, slurm-VERSION/: that names the prefix.
TOP=$(tar -tzf "$ARCHIVE" | head -n 1) || true
TOP=${TOP%%/*}
[[ $TOP =~ ^slurm-[0-9][0-9A-Za-z.-]*$ ]] || die "$ARCHIVE does not unpack to slurm-VERSION/ (got '$TOP')"
VERSION=${TOP#slurm-}
PREFIX=$ROOT/slurm-$VERSION
LOG=$ROOT/slurm-$VERSION.build.log
STAMP=$PREFIX/.kit-build-complete

# What the build does without: debugging symbols (-g), static libraries (libtool would compile
# every library object twice), and programs the test cluster never runs (slurmrestd, sview,
# X11 forwarding). Everything it needs is built: auth/none, cred/none, select/cons_tres,
# proctrack/cgroup, task/affinity, task/cgroup, cgroup/v1 and v2, gres/gpu, jobacct_gather,
# accounting_storage/slurmdbd and /mysql. Several slurmd on one host need multiple-slurmd.
OPTIONS=(--disable-debug --disable-static --disable-slurmrestd --disable-sview --disable-x11
    --disable-dependency-tracking --enable-multiple-slurmd)
# Plugins the test cluster loads: the build is complete only if each of these was installed
# (configure leaves out, silently, a plugin whose library it did not find). task/none and
# jobacct_gather/none are no plugins in 25.11: built into the daemons.
REQUIRED_PLUGINS=(auth_none cred_none select_cons_tres proctrack_cgroup proctrack_linuxproc
    task_affinity task_cgroup cgroup_v1 gres_gpu jobacct_gather_linux jobacct_gather_cgroup
    accounting_storage_slurmdbd accounting_storage_mysql)
# Debian packages the build needs (libmariadb-dev for accounting_storage/mysql, libdbus-1-dev
# for cgroup/v2, libjson-c-dev for the JSON output of the clients).
BUILD_PACKAGES=(build-essential pkg-config libmunge-dev libmariadb-dev libjson-c-dev libdbus-1-dev)

# The stamp says what was built: the archive's checksum and the options.
wanted_stamp() {
    echo "sha256 $(sha256sum "$ARCHIVE" | cut -d' ' -f1)"
    echo "options ${OPTIONS[*]}"
}

# One build at a time per version: a second caller waits, then finds the stamp.
exec 9>"$ROOT/slurm-$VERSION.lock"
flock 9

WANTED=$(wanted_stamp)
if [[ -f $STAMP && $(cat "$STAMP") == "$WANTED" ]]; then
    echo "$PREFIX"
    exit 0
fi

# ---------------------------------------------------------------------------------------------
# Build dependencies, from Debian's packages where they are missing.
installed_version() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null || true; }
is_installed() {
    [[ $(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null) == installed ]]
}

install_build_packages() {
    local missing=() pkg mariadb_version i
    command -v dpkg-query >/dev/null || { say "no dpkg: assuming the build dependencies are present"; return 0; }
    for pkg in "${BUILD_PACKAGES[@]}"; do is_installed "$pkg" || missing+=("$pkg"); done
    [[ ${#missing[@]} -gt 0 ]] || return 0
    [[ $(id -u) -eq 0 ]] || die "missing ${missing[*]} and not root: cannot apt-get install"
    # libmariadb-dev must match the client library already installed (the server's): an
    # unpinned install would upgrade libmariadb3 and with it the MariaDB server.
    mariadb_version=$(installed_version libmariadb3)
    [[ -n $mariadb_version ]] || mariadb_version=$(installed_version mariadb-server)
    if [[ -n $mariadb_version ]]; then
        for i in "${!missing[@]}"; do
            [[ ${missing[$i]} == libmariadb-dev ]] && missing[i]="libmariadb-dev=$mariadb_version"
        done
    fi
    say "installing ${missing[*]}"
    local apt=(apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=600)
    export DEBIAN_FRONTEND=noninteractive
    # Without refreshing the package lists first where that works (a fresh image has none).
    if ! "${apt[@]}" "${missing[@]}" >>"$LOG" 2>&1; then
        apt-get update -q -o DPkg::Lock::Timeout=600 >>"$LOG" 2>&1 || { tail -n 20 "$LOG" >&2; exit 1; }
        "${apt[@]}" "${missing[@]}" >>"$LOG" 2>&1 || { tail -n 40 "$LOG" >&2; exit 1; }
    fi
}

# ---------------------------------------------------------------------------------------------
START=$SECONDS
step_time() { echo "$((SECONDS - START)) s"; }
: >"$LOG"
say "building Slurm $VERSION into $PREFIX (about 4 min on 2 cores; log: $LOG)"
install_build_packages

BUILD=$(mktemp -d "$ROOT/build-$VERSION.XXXXXX")
trap 'rm -rf "$BUILD"' EXIT
tar -xzf "$ARCHIVE" -C "$BUILD"
SRC=$BUILD/$TOP

run_step() {   # $1 what, rest: command (run in $SRC, output to the log)
    local what=$1
    shift
    echo "===== $what: $*" >>"$LOG"
    (cd "$SRC" && "$@") >>"$LOG" 2>&1 || {
        tail -n 40 "$LOG" >&2
        die "$what failed after $(step_time) (log: $LOG)"
    }
    say "  $what done at $(step_time)"
}

rm -rf "$PREFIX"
run_step configure ./configure --prefix="$PREFIX" --sysconfdir="$PREFIX/etc" "${OPTIONS[@]}"
run_step make make -j"$(nproc)"
run_step "make install" make install

missing=()
for plugin in "${REQUIRED_PLUGINS[@]}"; do
    [[ -f $PREFIX/lib/slurm/$plugin.so ]] || missing+=("$plugin")
done
[[ ${#missing[@]} -eq 0 ]] || die "built without plugins ${missing[*]} (see configure in $LOG)"

# Last: only a complete prefix carries the stamp.
echo "$WANTED" >"$STAMP"
say "built Slurm $VERSION in $(step_time)"
if [[ ${TESTCLUSTER_VERBOSE:-0} == 1 ]]; then tail -n 5 "$LOG" >&2; fi
echo "$PREFIX"
