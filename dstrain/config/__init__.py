"""What to run, resolved once before anything is allocated: the options (options.py), the DeepSpeed file as the
user wrote it (ds_file.py), the DeepSpeed config with every "auto" filled (ds_config.py), and `prepare(...) ->
RunPlan` (plan.py), which every later component reads instead of the raw JSON."""
