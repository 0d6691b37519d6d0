import runpy

if __name__ == "__main__":  # not when a spawned process imports it as its main
    runpy.run_module("slurm_ddp_kit.analysis", run_name="__main__", alter_sys=True)
