"""Configs, the ``draftgym`` command line, runners (bench, run, train, sweep, report), plots."""
