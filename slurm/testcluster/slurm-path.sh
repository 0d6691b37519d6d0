# Sourced by the testcluster scripts: puts the Slurm that the test cluster runs on first on PATH.
# Daemons live in /usr/sbin, which a non-login shell may lack on PATH. A Slurm built apart
# (build-slurm.sh) is named by TESTCLUSTER_SLURM_PREFIX: its bin and sbin then come before the
# system's, for the daemons and for every client (a client of one release cannot talk to the
# daemons of another).
export PATH="$PATH:/usr/sbin:/sbin"
if [[ -n ${TESTCLUSTER_SLURM_PREFIX:-} ]]; then
    if [[ ! -x $TESTCLUSTER_SLURM_PREFIX/sbin/slurmctld ]]; then
        echo "testcluster: error: TESTCLUSTER_SLURM_PREFIX=$TESTCLUSTER_SLURM_PREFIX has no" \
            "sbin/slurmctld (build it with slurm/testcluster/build-slurm.sh)" >&2
        exit 1
    fi
    export PATH="$TESTCLUSTER_SLURM_PREFIX/bin:$TESTCLUSTER_SLURM_PREFIX/sbin:$PATH"
fi
