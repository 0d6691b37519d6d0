"""`python -m analysis …`: the analysis under the name the design gives it. Its code is
`slurm_ddp_kit.analysis`, a name no user project uses (see `launch/__init__.py`)."""
