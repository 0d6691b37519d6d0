"""`python -m train …`: what runs inside a job, under the name the design gives it. Its code is
`slurm_ddp_kit.train`, a name no user project uses (see `launch/__init__.py`); jobs the kit
starts run that name, so that a user's `train.py` beside them is never taken for it."""
