"""python -m tools.bench: the benchmark's command line (command.py)."""
from tools.bench.command import main

if __name__ == "__main__":
    main()
