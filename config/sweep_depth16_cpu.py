# The 16-layer cells of the depth experiment (docs/experiments.md, "The stream against depth") at 3 seeds:
# every residual mode, the quickstart recipe at 1000 iterations (not iso-FLOP: the same iterations and
# tokens for every mode), with diagnostics. block_attnres uses its default 8 blocks (of 2 layers), against
# full attnres. 15 runs, two at a time: 70 minutes on 2 cores (measured, with other work on the machine):
# OMP_NUM_THREADS=1 python flops.py sweep config/sweep_depth16_cpu.py

sweep_name = "sweep_depth16_cpu"
train_config = "config/shakespeare_char_cpu.py"
train_args = ["--device=cpu", "--dtype=float32", "--max_iters=1000", "--lr_decay_iters=1000", "--eval_interval=500", "--eval_iters=20",
              "--log_interval=250", "--diagnose=True"]
budget = None  # max_iters decides
depths = [16]
residuals = ["prenorm", "sandwich", "nag", "attnres", "block_attnres"]
seeds = [1, 2, 3]
jobs = 2
