#!/usr/bin/env bash
# Install Debian's Slurm (controller, node daemon, clients, accounting daemon), MariaDB, iproute2
# and nftables: everything slurm/testcluster/start.sh and the network tests need; and Environment
# Modules, as clusters give their Pythons (tests/test_python_envs.py). Idempotent:
# when all programs are present it only prints one line and returns at once (no apt-get at all).
# With TESTCLUSTER_SLURM_PREFIX (a Slurm built by build-slurm.sh) its programs count, and come
# first on PATH; the version printed is that of the Slurm on PATH.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/slurm-path.sh"

PACKAGES=(slurmctld slurmd slurm-client slurmdbd mariadb-server iproute2 nftables environment-modules)
# One program per package: if all of them are on PATH there is nothing to do.
PROGRAMS=(slurmctld slurmd sbatch sdiag slurmdbd mariadbd mariadb-install-db mariadb-admin ip nft modulecmd)

# The release on PATH (slurmctld -V prints "slurm 25.11.7" or "slurm-wlm 22.05.8"), which need
# not be Debian's package.
slurm_version() {
    local version
    version=$(slurmctld -V 2>/dev/null) || { echo '?'; return 0; }
    echo "${version##* } ($(command -v slurmctld))"
}

missing=()
for prog in "${PROGRAMS[@]}"; do
    if ! command -v "$prog" >/dev/null 2>&1; then
        missing+=("$prog")
    fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
    echo "testcluster: slurm $(slurm_version) and mariadb already installed"
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "testcluster: missing ${missing[*]} and not root: cannot apt-get install" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "testcluster: missing ${missing[*]} and no apt-get (not Debian/Ubuntu)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp -t testcluster-install.XXXXXX)
trap 'rm -f "$log"' EXIT

# policy-rc.d returning 101 stops the packages' postinst scripts from starting system-wide
# daemons (slurmctld, slurmd, munge, mariadb) that we do not want: the test cluster runs its
# own private copies. Only installed if nobody else put one there; removed afterwards.
policy=/usr/sbin/policy-rc.d
own_policy=0
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    own_policy=1
    trap 'rm -f "$log"; rm -f "$policy"' EXIT
fi

install() {
    apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >>"$log" 2>&1
}
# Try without refreshing the package lists first: on a machine that updated recently this
# saves the time of apt-get update; on a fresh image the lists are empty and install fails.
if ! install; then
    apt-get update -q >>"$log" 2>&1 || { cat "$log" >&2; exit 1; }
    install || { tail -n 40 "$log" >&2; exit 1; }
fi
if [[ $own_policy -eq 1 ]]; then rm -f "$policy"; fi

echo "testcluster: installed ${PACKAGES[*]} (slurm $(slurm_version))"
