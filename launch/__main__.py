import sys

from launch.cli import main

if __name__ == "__main__":  # not when a spawned process imports it as its main
    sys.exit(main())
