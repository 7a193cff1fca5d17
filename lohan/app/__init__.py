"""What a user runs: the command line (`cli`), the run driver (`train`: a `Run` of stages over `preflight`,
`opening`, `run_state`, `header`, `loop`, `failures`, `inputs`, `verify`), pre-flight checks (`fit`), the files a
run owns (`layout`, `ownership`), step records (`metrics`), their console report (`report`) and plot (`plot`), and
the capacity CLI (`capacity`, run as ``python -m lohan.capacity``)."""
