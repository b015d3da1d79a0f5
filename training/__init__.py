"""The machinery train.py needs around the five dimensions: its command line (cli), joining a launch and
failing on every rank alike (launch), the data (data) and a model's tokenizer (tokenizer), sharded
checkpoints (checkpoint), Hugging Face model folders (hf), the memory meter (meter) and the traces of
--profile's steps (profile)."""
