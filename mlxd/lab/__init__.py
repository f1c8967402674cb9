"""Lab jobs' worker processes: fine-tunes, quantizations and the like, each in a process of its
own started by the supervisor (supervisor/jobs/runner.py), on mlx-lm's own tools."""
