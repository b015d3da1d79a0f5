"""What a layout's ranks hold, counted without building them: train.py's check of the parameters' memory before
anything is allocated, and the floor tools/plan/ predicts on (its package docstring lists the modules)."""
