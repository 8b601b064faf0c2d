"""What a command does past parsing (cli.py parses): validate.py and preflight.py check a
job before anything is written, pipeline.py runs it (worker.py per rank), plan.py and
distance.py are `specft plan` and `specft distance`."""
