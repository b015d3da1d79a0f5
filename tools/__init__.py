"""Commands a user runs beside training, each from the repository's top folder as `python -m tools.NAME`:
the benchmark (bench), the planner (plan), the dry run of one rank of a large world (dryrun), your text as
tokens (prepare), and the conversions of checkpoints to and from one file and Hugging Face folders (convert)."""
