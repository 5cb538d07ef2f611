"""The harness of benches/step.py, what every system (benches/systems/) runs under:

  run.py         the processes: world 1 without torchrun, devices, a process group per system,
                 error records, the environment in the record, printing and --out
  measure.py     one system: build, warm-up, timed steps, the record's metrics
  data.py        each rank's random-token batches, --varlen lengths and their metrics
  device.py      device sync, peak memory, dynamo's graph count and compile timers
  profiling.py   --trace, --host-profile, --first-profile and --memory
  table.py       the Markdown table (--table) and the JSON-lines reader

step.py parses the command line and hands it to run.worker (or prints a table)."""
