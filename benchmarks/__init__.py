"""The benchmarks: `llmserve bench ...` (one subcommand per module, commands.py) and the
micro-benchmarks run with `python -m benchmarks.NAME`. A package beside `services`, in a source
checkout and its editable install but not in the service image: a benchmark imports the services'
public modules, no service imports a benchmark (the import-linter contracts in pyproject.toml)."""
