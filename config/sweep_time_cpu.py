# Equal time on this CPU: how much a seconds budget spreads the runs of one cell (their iterations and
# FLOPs follow each run's pace), and what prenorm and nag reach in the same training time. The sweep's
# own setting: two runs at a time, one thread each. 2 cells x 4 seeds at 120 s of training, ~10 minutes:
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_time_cpu.py

sweep_name = "sweep_time_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--eval_interval=100000", "--eval_iters=20", "--log_interval=50"]
budget = None
budget_seconds = 120  # seconds of training per run (train.py --max_seconds)
depths = [4]
residuals = ["prenorm", "nag"]
seeds = [1, 2, 3, 4]
jobs = 2
