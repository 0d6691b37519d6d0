"""The kit's torch-free core, shared by `launch`, `train` and `analysis`.

Settings (schema, rules, loading), the strategies' registry, the run folder, the user's factories,
the one Slurm module, the error class and the command-line helpers. Importing any of it never
imports torch: the launcher and the analysis run where torch is slow to load or absent. Only a
strategy's job-side methods (`wrap`, `save_shards`, …) import torch, when a job calls them.
"""
