"""``python -m mpistrat``: the same as the ``mpistrat`` command (works under mpiexec/srun)."""

from mpistrat.cli import main

if __name__ == "__main__":
    main(prog_name="mpistrat")
