"""User tasks as console commands (setup.py's entry points): preparing parallel text, BLEU
evaluation, attention heat-maps, checkpoint averaging, local CPU ranks, the reverse task's data."""
