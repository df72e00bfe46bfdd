"""What a run reports: TensorBoard and the scalar writers (writers), the per-update logging
callback (run_logs), ``metrics.csv`` (csv_file), MLflow (mlflow_run), the console (console),
memory (memory) and throughput (throughput).
"""
