import sys

try:
    from slurm_ddp_kit.launch.cli import main
except KeyboardInterrupt:  # Ctrl-C while the command loads: one line, as at any later instant
    sys.stderr.write("interrupted\n")
    sys.exit(130)

if __name__ == "__main__":  # not when a spawned process imports it as its main
    sys.exit(main())
