from experiments.cli import entry

entry()
