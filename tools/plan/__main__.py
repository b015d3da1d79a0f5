"""python -m tools.plan: the planner's command line (command.py)."""
from tools.plan.command import main

if __name__ == "__main__":
    main()
