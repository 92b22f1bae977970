"""One module per DVC stage (dvc.yaml), each with ``run``: read the stage's inputs, call the domain
code, write its outputs. ``cli.py`` maps ``cellpath <stage>`` to ``stages.<stage>.run``."""
