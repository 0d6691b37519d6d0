"""`python -m launch …`: the launcher under the name the design gives it. Its code is
`slurm_ddp_kit.launch`, a name no user project uses, so that a `train.py`, `core/` or
`analysis.py` of the user's on the path changes nothing the kit imports."""
