"""`python -m dspark_export`: the `dspark-export` command."""

from dspark_export.cli import main

main(prog_name="dspark-export")
