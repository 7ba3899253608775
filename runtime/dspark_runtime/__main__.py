"""`python -m dspark_runtime`: the `dspark-run` command."""

from dspark_runtime.cli import main

main(prog_name="dspark-run")
